"""The asyncio-thread bridge (docs/reference/worker.md#the-asyncio-thread-bridge), with a fake Dynamo context and a fake sidecar.

These tests need no Dynamo install: the bridge only sees a context with ``id()``,
``async_killed_or_stopped()`` and ``notify_first_token()``, and a ``generate(request, ctx)`` context manager.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from trio_sidecar.core.errors import (
    CannotConnect,
    ConnectionTimeout,
    EngineShutdown,
    InvalidArgument,
    ProtocolError,
    RequestCancelled,
    SidecarError,
)
from trio_sidecar.dynamo.bridge import (
    QUEUE_WARN_THRESHOLD,
    SHUTTING_DOWN,
    RequestBridge,
    RequestItem,
)
from trio_sidecar.dynamo.egress import Egress as _Egress
from trio_sidecar.dynamo.error_map import dynamo_exception
from trio_sidecar.dynamo.thread import AsyncioThread
from trio_sidecar.dynamo.wakeup import Outbox
from trio_sidecar.shell.context import GenerateContext

pytestmark = pytest.mark.dynamo

CANCELLED = {"token_ids": [], "index": 0, "finish_reason": "cancelled"}


def tokens_of(chunks: list) -> list[int]:
    """All token ids of a handler's output (chunks may be coalesced under back-pressure)."""
    return [t for c in chunks for t in c["token_ids"]]


class Chunk:
    def __init__(self, data: dict) -> None:
        self.data = data

    def to_dict(self) -> dict:
        return dict(self.data)


class FakeDynamoContext:
    """The asyncio-side request context (Dynamo's ``Context``); used only on the loop thread."""

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


class FakeSidecar:
    """``generate`` yields ``plan`` chunks; with ``hold`` it waits for stop after the first chunk."""

    def __init__(self, *, plan: int = 3, hold: bool = False, error: Exception | None = None) -> None:
        self.plan = plan
        self.hold = hold
        self.error = error
        self.contexts: dict[str, GenerateContext] = {}
        self.finished: list[str] = []

    @asynccontextmanager
    async def generate(self, request: dict, ctx: GenerateContext):
        self.contexts[ctx.request_id] = ctx
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
                    yield Chunk({"token_ids": [request["token_ids"][0] + i], "index": 0})
                    await trio.lowlevel.checkpoint()
            finally:
                self.finished.append(ctx.request_id)

        yield chunks()


def submitter(generate, nursery: trio.Nursery):
    """``Sidecar.submit``'s contract over a fake ``generate()``: one task per request drives the sink."""

    def submit(request: dict, ctx, sink) -> None:
        async def run() -> None:
            try:
                async with generate(request, ctx) as chunks:
                    async for chunk in chunks:
                        sink.chunk(chunk)
            except Exception as exc:  # noqa: BLE001 - handed to the sink, as the engine does
                sink.end(None, exc)
            else:
                sink.end(None, None)

        nursery.start_soon(run)

    return submit


async def wait_idle(bridge: RequestBridge) -> None:
    """Until the bridge routes no request any more (every sink ended: the fake sidecar's tasks are done)."""
    with trio.fail_after(10):
        while bridge.in_flight:
            await trio.sleep(0.001)


@pytest.fixture
async def loop_thread():
    thread = AsyncioThread()
    await thread.start()
    try:
        yield thread
    finally:
        await thread.stop()


@asynccontextmanager
async def running_bridge(thread: AsyncioThread, sidecar: FakeSidecar, *, dispatch: bool = True):
    bridge = RequestBridge(thread)
    async with trio.open_nursery() as nursery:
        if dispatch:
            nursery.start_soon(bridge.run_dispatcher, submitter(sidecar.generate, nursery))
        yield bridge, nursery
        nursery.cancel_scope.cancel()


async def consume(
    bridge: RequestBridge,
    request: dict,
    context: FakeDynamoContext,
    *,
    close_after=None,
    stop_after=None,
    pause_first: float = 0.0,
    stall_until=None,
):
    """Runs on the asyncio thread, as Dynamo's runtime would drive the handler.

    ``stall_until``: after the first item, stop reading until this predicate holds (a stalled consumer whose
    stall is defined by the producer's progress, not by a wall-clock guess).
    """
    out: list = []
    agen = bridge.handler(request, context)
    try:
        async for item in agen:
            out.append(item)
            if pause_first and len(out) == 1:
                await asyncio.sleep(pause_first)  # a stalled consumer
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


@pytest.mark.parametrize("plan", [1, 3])
async def test_chunks_flow_from_trio_to_the_dynamo_handler_in_order(loop_thread, plan):
    sidecar = FakeSidecar(plan=plan)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        ctx = FakeDynamoContext("req-1")
        out = await loop_thread.run(consume, bridge, {"token_ids": [100]}, ctx)
        await wait_idle(bridge)
    assert tokens_of(out) == [100 + i for i in range(plan)]
    assert all(c == {"token_ids": c["token_ids"], "index": 0} for c in out)
    assert sidecar.finished == ["req-1"]
    assert sidecar.contexts["req-1"].stopped is False
    assert bridge.completed == 1


async def test_cancel_before_the_trio_task_starts_is_not_lost(loop_thread):
    sidecar = FakeSidecar(plan=5)
    async with running_bridge(loop_thread, sidecar, dispatch=False) as (bridge, nursery):
        ctx = FakeDynamoContext("early", stopped=True)  # killed before the request reaches Trio
        result: list = []

        async def drive():
            result.extend(await loop_thread.run(consume, bridge, {"token_ids": [7]}, ctx))

        nursery.start_soon(drive)
        # The spawn and the stop request both arrive before the dispatcher exists.
        with trio.fail_after(10):
            while not (bridge._pending and bridge._pending[0].ctx.stopped):
                await trio.sleep(0.01)
        nursery.start_soon(bridge.run_dispatcher, submitter(sidecar.generate, nursery))
        with trio.fail_after(10):
            while not result:
                await trio.sleep(0.01)
    assert result == [CANCELLED]
    assert sidecar.contexts["early"].stopped is True


async def test_stop_from_dynamo_mid_stream_ends_with_the_cancelled_chunk(loop_thread):
    sidecar = FakeSidecar(plan=5, hold=True)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        ctx = FakeDynamoContext("mid")
        with trio.fail_after(10):
            out = await loop_thread.run(partial(consume, stop_after=1), bridge, {"token_ids": [1]}, ctx)
            await wait_idle(bridge)
    assert out == [{"token_ids": [1], "index": 0}, CANCELLED]
    assert sidecar.contexts["mid"].stopped


async def test_runtime_closing_the_generator_stops_the_trio_request(loop_thread):
    sidecar = FakeSidecar(plan=5, hold=True)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        ctx = FakeDynamoContext("closed")
        with trio.fail_after(10):
            out = await loop_thread.run(partial(consume, close_after=1), bridge, {"token_ids": [1]}, ctx)
            await wait_idle(bridge)
    assert out == [{"token_ids": [1], "index": 0}]
    assert sidecar.contexts["closed"].stopped is True
    assert sidecar.finished == ["closed"]


def _sidecar_error(raised: BaseException) -> BaseException:
    """The SidecarError behind what the handler raised (Dynamo's typed exception chains to it)."""
    return raised if isinstance(raised, SidecarError) else raised.__cause__


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


async def test_sidecar_error_is_raised_from_the_handler_with_its_text(loop_thread):
    sidecar = FakeSidecar(error=InvalidArgument("max_tokens must be at least 1"))
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        out = await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("bad"))
        await wait_idle(bridge)
    assert len(out) == 1
    assert isinstance(_sidecar_error(out[0]), InvalidArgument)
    assert str(out[0]) == "max_tokens must be at least 1"


async def test_a_request_that_submit_refuses_ends_at_once_with_its_error(loop_thread):
    # Sidecar.submit raises conversion and admission errors synchronously, from the hand-over callback.
    submitted: list[str] = []

    def submit(request, ctx, sink):
        submitted.append(ctx.request_id)
        raise InvalidArgument("max_tokens must be at least 1")

    bridge = RequestBridge(loop_thread)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, submit)
        with trio.fail_after(10):
            out = await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("refused"))
            await wait_idle(bridge)
        nursery.cancel_scope.cancel()
    assert submitted == ["refused"]
    assert len(out) == 1 and isinstance(_sidecar_error(out[0]), InvalidArgument)
    assert str(out[0]) == "max_tokens must be at least 1"
    assert bridge.in_flight == 0 and bridge.completed == 1


async def test_stopping_the_dispatcher_ends_in_flight_requests_with_engine_shutdown(loop_thread):
    sidecar = FakeSidecar(plan=5, hold=True)
    bridge = RequestBridge(loop_thread)
    results: dict[str, list] = {}
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as requests:
            requests.start_soon(bridge.run_dispatcher, submitter(sidecar.generate, outer))

            async def drive(rid):
                results[rid] = await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext(rid))

            for rid in ("a", "b"):
                outer.start_soon(drive, rid)
            with trio.fail_after(10):
                while bridge.in_flight < 2 or len(sidecar.contexts) < 2:
                    await trio.sleep(0.01)
            requests.cancel_scope.cancel()  # what the worker does after the drain
        with trio.fail_after(10):
            while len(results) < 2:
                await trio.sleep(0.01)
    for rid, out in results.items():
        assert out[0] == {"token_ids": [1], "index": 0}
        assert isinstance(_sidecar_error(out[-1]), EngineShutdown) and str(out[-1]) == SHUTTING_DOWN
        assert sidecar.contexts[rid].stopped is True  # the Trio side was told to stop too
    assert bridge.in_flight == 0


async def test_chunks_emitted_in_one_trio_batch_wake_the_loop_once(loop_thread, monkeypatch):
    # vLLM answers all its streams at once and the connections' reads complete in one Trio batch: their
    # chunks must cost one call_soon_threadsafe (an eventfd write and a loop wake-up), not one per request.
    from trio_sidecar.dynamo import bridge as bridge_module
    from trio_sidecar.dynamo import wakeup as wakeup_module

    wakes: list[int] = []
    original = wakeup_module.Waker.wake_loop

    def counting_wake_loop(self):
        wakes.append(1)
        original(self)

    monkeypatch.setattr(wakeup_module.Waker, "wake_loop", counting_wake_loop)
    outboxes: list = []

    class TrackedOutbox(wakeup_module.Outbox):
        def __init__(self) -> None:
            super().__init__()
            outboxes.append(self)

    monkeypatch.setattr(bridge_module, "Outbox", TrackedOutbox)

    def all_parked() -> bool:  # every handler waits on its empty outbox
        return len(outboxes) == 8 and all(o.waiter is not None and not o.items for o in outboxes)

    sinks: dict[str, object] = {}

    def submit(request, ctx, sink):
        sinks[ctx.request_id] = sink

    bridge = RequestBridge(loop_thread)
    results: dict[str, list] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, submit)

        async def drive(rid):
            results[rid] = await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext(rid))

        rids = [f"r{i}" for i in range(8)]
        for rid in rids:
            nursery.start_soon(drive, rid)
        with trio.fail_after(10):
            while len(sinks) < 8 or not all_parked():
                await trio.sleep(0.01)
            wakes.clear()
            for rid in rids:  # one Trio step: every sink gets its first chunk
                sinks[rid].chunk(Chunk({"token_ids": [7], "index": 0}))
            assert wakes == []  # deferred to the dispatcher, after the tasks that are ready now
            while not wakes:
                await trio.lowlevel.checkpoint()
            while not all_parked():  # every handler took its chunk and parked again
                await trio.sleep(0.01)
            assert wakes == [1]
            for rid in rids:
                sinks[rid].end(None, None)
            while len(results) < 8:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert all(out == [{"token_ids": [7], "index": 0}] for out in results.values())


@pytest.mark.parametrize(("token_ids", "text"), [([5], ""), ([5], " five"), ([5, 6, 7], "abc"), ([], "")])
def test_the_sinks_token_fast_path_emits_the_dict_of_the_same_chunk(token_ids, text):
    from trio_sidecar.core.protocol import token_chunk
    from trio_sidecar.dynamo.bridge import _Sink

    emitted: list = []

    def sink_for(rid: str):
        item = RequestItem({}, rid, emitted.append, GenerateContext(rid))
        return _Sink(RequestBridge.__new__(RequestBridge), item)

    sink_for("fast").tokens(list(token_ids), text)
    sink_for("slow").chunk(token_chunk(list(token_ids), text))
    assert emitted[0] == emitted[1]
    assert type(emitted[0]["token_ids"]) is list


def deferred_until_the_transfer(nursery: trio.Nursery):
    """``Sidecar.submit`` for a decode request whose client left before the first token (decode deferral,
    docs/reference/sidecar.md#decode-deferral): an output without tokens, then, once stopped, the transfer
    completes: ``ctx.on_first_token`` and the cancelled chunk in place of the first token's chunk."""

    def submit(request: dict, ctx, sink) -> None:
        async def run() -> None:
            sink.chunk(Chunk({"token_ids": [], "index": 0, "step": 0}))
            await ctx.wait_stopped()
            ctx._notify_first_token()
            sink.end(Chunk(CANCELLED), None)

        nursery.start_soon(run)

    return submit


async def test_the_deferred_first_token_is_notified_on_the_loop_after_the_handler_is_gone(loop_thread):
    bridge = RequestBridge(loop_thread, bind_context=lambda context, request: True)
    ctx = FakeDynamoContext("deferred")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, deferred_until_the_transfer(nursery))
        with trio.fail_after(10):
            out = await loop_thread.run(partial(consume, close_after=1), bridge, {"token_ids": [1]}, ctx)
            await wait_idle(bridge)
            while not ctx.first_token_threads:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()

    async def loop_thread_id():
        return threading.get_ident()

    assert out == [{"token_ids": [], "index": 0, "step": 0}]  # the handler left after its first output
    assert ctx.first_token_threads == [await loop_thread.run(loop_thread_id)]


async def test_an_unbound_request_gets_no_first_token_callback(loop_thread):
    seen: list = []

    def submit(request: dict, ctx, sink) -> None:
        seen.append(ctx.on_first_token)
        sink.end(None, None)

    bridge = RequestBridge(loop_thread, bind_context=lambda context, request: False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, submit)
        with trio.fail_after(10):
            await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("unbound"))
        nursery.cancel_scope.cancel()
    assert seen == [None]  # nothing to notify: no per-request callback on the loop


async def test_a_stalled_consumer_is_reported_once(loop_thread, caplog):
    # The handler may coalesce up to the threshold into the first item before the stall begins; with more
    # than twice the threshold the backlog still exceeds it at the first or the second read.
    plan = 2 * QUEUE_WARN_THRESHOLD + 50
    sidecar = FakeSidecar(plan=plan)
    caplog.set_level(logging.WARNING, logger="trio_sidecar.dynamo.bridge")
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        with trio.fail_after(30):
            # Stall until the producer has emitted every chunk, so the backlog exceeds the threshold however
            # slowly a loaded machine schedules the Trio side.
            out = await loop_thread.run(
                partial(consume, stall_until=lambda: "slow" in sidecar.finished),
                bridge,
                {"token_ids": [0]},
                FakeDynamoContext("slow"),
            )
            await wait_idle(bridge)
    assert tokens_of(out) == list(range(plan))
    assert len(out) < QUEUE_WARN_THRESHOLD  # the backlog was coalesced into multi-token deltas
    stalled = [r for r in caplog.records if "consumer is stalled" in r.getMessage()]
    assert len(stalled) == 1


async def test_run_returns_results_and_raises_exceptions_from_the_loop(loop_thread):
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def fail():
        raise ValueError("boom")

    assert await loop_thread.run(add, 2, 3) == 5
    with pytest.raises(ValueError, match="boom"):
        await loop_thread.run(fail)


async def test_the_worker_runs_the_asyncio_thread_on_uvloop_like_dynamos_own_workers():
    uvloop = pytest.importorskip("uvloop")
    from trio_sidecar.dynamo.worker import _loop_factory

    assert _loop_factory() is uvloop.new_event_loop
    thread = AsyncioThread(loop_factory=_loop_factory())
    await thread.start()
    try:

        async def loop_type():
            return type(asyncio.get_running_loop())

        assert await thread.run(loop_type) is uvloop.Loop
    finally:
        await thread.stop()


async def test_cancelling_a_trio_caller_cancels_the_asyncio_task(loop_thread):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with trio.move_on_after(0.2):
        await loop_thread.run(forever)
    await trio.to_thread.run_sync(cancelled.wait, 5)
    assert cancelled.is_set()


async def test_many_concurrent_streams_lose_no_chunk_and_keep_order(loop_thread):
    """The coalesced wake-up handshake under contention: 40 streams x 300 chunks, all delivered in order."""
    sidecar = FakeSidecar(plan=300)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):

        async def consume_all():
            return await asyncio.gather(
                *(consume(bridge, {"token_ids": [i * 1000]}, FakeDynamoContext(f"r{i}")) for i in range(40))
            )

        with trio.fail_after(60):
            outs = await loop_thread.run(consume_all)
            await wait_idle(bridge)
    for i, out in enumerate(outs):
        assert tokens_of(out) == [i * 1000 + k for k in range(300)]
        assert all(c["index"] == 0 for c in out)
    assert bridge.completed == 40


# -- push egress (Dynamo 1.6.1 passes a ResponseSender to a handler that declares ``response_sender``) ----


class FakeResponseSender:
    """Dynamo's ``ResponseSender``: ``send`` queues a frame on the request's bounded channel and blocks its
    caller while the channel is full; it raises ``RuntimeError`` once the response stream is gone.

    ``capacity`` frames may be unread at once (None: unbounded); ``read(n)`` is the consumer reading.
    """

    def __init__(self, *, capacity: int | None = None, gone_after: int | None = None) -> None:
        self.frames: list[dict] = []
        self.send_threads: list[str] = []
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
        self.send_threads.append(threading.current_thread().name)

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


class StepSidecar:
    """Yields ``plan`` chunks that are never coalesced (each carries a key that is not a plain delta's)."""

    def __init__(self, plan: int) -> None:
        self.plan = plan
        self.finished: list[str] = []

    @asynccontextmanager
    async def generate(self, request: dict, ctx: GenerateContext):
        async def chunks():
            try:
                for i in range(self.plan):
                    yield Chunk({"token_ids": [request["token_ids"][0] + i], "index": 0, "step": i})
                    await trio.lowlevel.checkpoint()
            finally:
                self.finished.append(ctx.request_id)

        yield chunks()


async def test_the_handler_declares_response_sender_so_dynamo_serves_it_with_push_egress(loop_thread):
    # Dynamo 1.6.1 picks the push egress for a handler whose signature has a `response_sender` parameter.
    import inspect

    bridge = RequestBridge(loop_thread)
    assert "response_sender" in inspect.signature(bridge.handler).parameters
    assert inspect.isasyncgen(bridge.handler({"token_ids": [1]}, FakeDynamoContext("x")))  # pull: no sender


async def test_push_egress_sends_every_chunk_in_order_on_the_loop_and_closes_once(loop_thread):
    sidecar = FakeSidecar(plan=5)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        sender = FakeResponseSender()
        error = await loop_thread.run(push, bridge, {"token_ids": [100]}, FakeDynamoContext("p1"), sender)
        await wait_idle(bridge)

    async def loop_thread_name():
        return threading.current_thread().name

    assert error is None
    assert tokens_of(sender.frames) == [100 + i for i in range(5)]
    assert sender.closed == 1
    assert set(sender.send_threads) == {await loop_thread.run(loop_thread_name)}
    assert sidecar.contexts["p1"].stopped is False


async def test_push_egress_raises_a_sidecar_error_as_its_typed_exception(loop_thread):
    # The exception leaves the handler, so Dynamo classifies it and ends the stream with a typed error frame.
    sidecar = FakeSidecar(error=InvalidArgument("max_tokens must be at least 1"))
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        sender = FakeResponseSender()
        error = await loop_thread.run(push, bridge, {"token_ids": [1]}, FakeDynamoContext("bad"), sender)
        await wait_idle(bridge)
    assert isinstance(_sidecar_error(error), InvalidArgument)
    assert str(error) == "max_tokens must be at least 1"
    assert sender.frames == [] and sender.closed == 0


async def test_push_egress_stop_from_dynamo_mid_stream_sends_the_cancelled_chunk(loop_thread):
    sidecar = FakeSidecar(plan=5, hold=True)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        ctx = FakeDynamoContext("mid")
        sender = FakeResponseSender()

        async def drive():
            task = asyncio.ensure_future(push(bridge, {"token_ids": [1]}, ctx, sender))
            while not sender.frames:
                await asyncio.sleep(0.005)
            ctx.stop_generating()
            return await task

        with trio.fail_after(10):
            error = await loop_thread.run(drive)
            await wait_idle(bridge)
    assert error is None
    assert sender.frames == [{"token_ids": [1], "index": 0}, CANCELLED]
    assert sender.closed == 1


async def test_push_egress_stops_the_trio_request_when_the_response_stream_is_gone(loop_thread):
    sidecar = FakeSidecar(plan=5, hold=True)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        # The first frame is taken, then the consumer is gone: the next send raises RuntimeError.
        sender = FakeResponseSender(gone_after=1)
        ctx = FakeDynamoContext("gone")

        async def drive():
            task = asyncio.ensure_future(push(bridge, {"token_ids": [1]}, ctx, sender))
            while not sender.frames:
                await asyncio.sleep(0.005)
            ctx.stop_generating()  # Dynamo stops the context when the consumer goes away
            return await task

        with trio.fail_after(10):
            error = await loop_thread.run(drive)
            await wait_idle(bridge)
    assert error is None
    assert sender.frames == [{"token_ids": [1], "index": 0}]
    assert sidecar.contexts["gone"].stopped
    assert sidecar.finished == ["gone"]


async def test_a_full_response_channel_parks_an_egress_thread_never_the_loop(loop_thread):
    # Past its inline window a request's frames go through egress threads: while its consumer does not read
    # (the channel is full and send() blocks), other requests still flow, and its own frames stay in order.
    plan = 8
    sidecar = StepSidecar(plan)
    async with running_bridge(loop_thread, sidecar) as (bridge, nursery):
        bridge.push_inline_frames = 2
        stalled = FakeResponseSender(capacity=3)  # room for 3 unread frames: the 4th send blocks
        outcome: list = []

        async def drive_stalled():
            outcome.append(await loop_thread.run(push, bridge, {"token_ids": [0]}, FakeDynamoContext("s"), stalled))

        nursery.start_soon(drive_stalled)
        try:
            with trio.fail_after(10):
                await trio.to_thread.run_sync(stalled.blocked.wait)
                # The loop is free: another request is served from start to end while the first one is stuck.
                other = FakeResponseSender()
                assert await loop_thread.run(push, bridge, {"token_ids": [1000]}, FakeDynamoContext("o"), other) is None
                assert tokens_of(other.frames) == [1000 + i for i in range(plan)] and other.closed == 1
                assert len(stalled.frames) == 3 and not outcome
        finally:
            stalled.read(plan)  # the consumer reads again (also unblocks whatever waits, should this fail)
        with trio.fail_after(10):
            while not outcome:
                await trio.sleep(0.01)
            await wait_idle(bridge)
    assert outcome == [None]
    assert tokens_of(stalled.frames) == list(range(plan))
    assert stalled.closed == 1
    assert [name.startswith("dynamo-egress-") for name in stalled.send_threads] == [False, False] + [True] * 6


async def test_push_egress_many_concurrent_streams_lose_no_chunk_and_keep_order(loop_thread):
    """The flush's inline sends under contention (the re-published waiter handshake): 40 streams x 300
    chunks, every frame delivered once, in order, with the window crossed to the egress threads."""
    sidecar = FakeSidecar(plan=300)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        bridge.push_inline_frames = 50
        senders = [FakeResponseSender() for _ in range(40)]

        async def push_all():
            return await asyncio.gather(
                *(push(bridge, {"token_ids": [i * 1000]}, FakeDynamoContext(f"p{i}"), senders[i]) for i in range(40))
            )

        with trio.fail_after(60):
            errors = await loop_thread.run(push_all)
            await wait_idle(bridge)
    assert errors == [None] * 40
    for i, sender in enumerate(senders):
        assert tokens_of(sender.frames) == [i * 1000 + k for k in range(300)]
        assert sender.closed == 1
    assert bridge.completed == 40


async def test_push_egress_raises_an_unexpected_send_failure_from_the_handler(loop_thread):
    # A send that fails with anything but the closed-stream RuntimeError, also while the loop's flush sends
    # for a parked handler, is raised by the handler (Dynamo reports it) and stops the Trio request.
    class BrokenSender(FakeResponseSender):
        def send(self, obj: dict) -> None:
            if self.frames:
                raise ValueError("cannot encode")
            super().send(obj)

    sidecar = FakeSidecar(plan=5, hold=True)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        sender = BrokenSender()
        ctx = FakeDynamoContext("broken")

        async def drive():
            task = asyncio.ensure_future(push(bridge, {"token_ids": [1]}, ctx, sender))
            while not sender.frames:
                await asyncio.sleep(0.005)
            ctx.stop_generating()  # the next chunk (the cancelled one) is sent while the handler is parked
            return await task

        with trio.fail_after(10):
            error = await loop_thread.run(drive)
            await wait_idle(bridge)
    assert isinstance(error, ValueError) and str(error) == "cannot encode"
    assert sender.frames == [{"token_ids": [1], "index": 0}]
    assert sidecar.contexts["broken"].stopped


async def test_push_egress_sends_nothing_after_a_failed_send(loop_thread):
    # One frame fails to send (not a closed stream): the handler raises that error, and no later frame of the
    # request goes out meanwhile (Dynamo would get a stream with a hole in it).
    class FailsOnce(FakeResponseSender):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def send(self, obj: dict) -> None:
            self.calls += 1
            if self.calls == 2:
                raise ValueError("cannot encode the second frame")
            super().send(obj)

    sidecar = StepSidecar(6)  # six frames (never coalesced)
    async with running_bridge(loop_thread, sidecar) as (bridge, _):
        sender = FailsOnce()
        with trio.fail_after(10):
            error = await loop_thread.run(push, bridge, {"token_ids": [10]}, FakeDynamoContext("hole"), sender)
            await wait_idle(bridge)
    assert isinstance(error, ValueError) and str(error) == "cannot encode the second frame"
    assert tokens_of(sender.frames) == [10]
    assert sender.calls == 2


async def test_a_request_handed_over_after_the_dispatcher_stopped_is_refused_not_lost(loop_thread):
    sidecar = FakeSidecar()
    bridge = RequestBridge(loop_thread)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, submitter(sidecar.generate, nursery))
        await trio.testing.wait_all_tasks_blocked()  # the dispatcher runs (and is parked)
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        out = await loop_thread.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("late"))
    assert len(out) == 1 and isinstance(_sidecar_error(out[0]), EngineShutdown)
    assert str(out[0]) == SHUTTING_DOWN
    assert sidecar.contexts == {} and bridge.in_flight == 0


class GatedSends:
    """``stalled`` is a ``ResponseSender.send`` whose consumer does not read until ``gate`` is set; what
    was sent (by it or by ``sent.append``, a consumer that reads) is in ``sent``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[str] = []

    def stalled(self, out: str) -> None:
        self.gate.wait(10)
        self.sent.append(out)


async def test_egress_threads_grow_so_stalled_consumers_never_hold_up_other_requests(loop_thread):
    # Ten consumers stalled at once each park their own egress thread; a frame of another request still goes
    # out at once; idle threads exit.
    sends = GatedSends()
    gate, sent, stalled_send = sends.gate, sends.sent, sends.stalled

    async def scenario():
        egress = _Egress(asyncio.get_running_loop(), idle_exit=0.2)
        stalled = [egress.send(stalled_send, f"stalled-{i}") for i in range(10)]
        other = egress.send(sent.append, "other")
        await asyncio.wait_for(other, 5)  # not behind the stalled ones
        assert sent == ["other"] and egress.threads == 11
        gate.set()
        await asyncio.wait_for(asyncio.gather(*stalled), 5)
        while egress.threads:  # every thread exits once idle for idle_exit
            await asyncio.sleep(0.05)
        again = egress.send(sent.append, "again")  # and a new one starts for the next frame
        await asyncio.wait_for(again, 5)
        return egress.threads

    with trio.fail_after(20):
        assert await loop_thread.run(scenario) == 1
    assert sorted(sent) == sorted(["other", "again", *(f"stalled-{i}" for i in range(10))])


async def test_egress_at_its_thread_cap_queues_frames_for_the_next_free_thread(loop_thread):
    sends = GatedSends()
    gate, sent, stalled_send = sends.gate, sends.sent, sends.stalled

    async def scenario():
        egress = _Egress(asyncio.get_running_loop(), max_threads=2)
        stalled = [egress.send(stalled_send, f"stalled-{i}") for i in range(2)]
        queued = egress.send(sent.append, "queued")
        await asyncio.sleep(0.2)
        assert not queued.done() and egress.threads == 2  # at the cap: waits for a free thread
        gate.set()
        await asyncio.wait_for(asyncio.gather(queued, *stalled), 5)
        later = [egress.send(sent.append, f"later-{i}") for i in range(3)]  # the counts are consistent again
        await asyncio.wait_for(asyncio.gather(*later), 5)
        return egress.threads

    with trio.fail_after(20):
        assert await loop_thread.run(scenario) == 2
    assert sorted(sent) == sorted(["queued", "stalled-0", "stalled-1", "later-0", "later-1", "later-2"])


# -- coalescing a run of queued deltas at once (``_Stream.take``) ------------------------------------------


def test_a_waiter_abandoned_in_the_publish_race_is_never_drained_or_republished():
    """An emit that lands between the handler publishing its waiter and re-checking the deque queues that
    waiter for a flush, although the handler returns without awaiting it and parks on a new one. The flush
    must skip the abandoned waiter: draining for it would re-publish it over the new one, and the end would
    then wake a future nobody awaits (the request would never finish)."""
    from trio_sidecar.dynamo.bridge import END, _Stream
    from trio_sidecar.dynamo.wakeup import Waker

    class RacyOutbox(Outbox):
        """Trio's emit happens right after the first waiter is published (the race window)."""

        __slots__ = ("_waiter", "race")

        def __init__(self) -> None:
            self._waiter = None
            self.race = None
            super().__init__()

        @property
        def waiter(self):
            return self._waiter

        @waiter.setter
        def waiter(self, value) -> None:
            self._waiter = value
            if value is not None and self.race is not None:
                race, self.race = self.race, None
                race()

    async def scenario():
        loop = asyncio.get_running_loop()
        waker = Waker(loop, lambda: None)  # flushes are run by hand below
        outbox = RacyOutbox()
        stream = _Stream(loop, outbox, "race", lambda: None)
        sent: list = []

        def drain() -> bool:
            while outbox.items:
                if outbox.items[0] is END:
                    return True
                sent.append(stream.take())
            return False

        outbox.race = lambda: waker.emit(outbox, {"token_ids": [1], "index": 0})

        async def handler() -> str:
            while True:
                if not drain():
                    await stream.wait(drain)
                    continue
                assert stream.take() is END
                return "ended"

        task = asyncio.ensure_future(handler())
        for _ in range(5):
            await asyncio.sleep(0)  # the handler lost the race, drained the token and parks on a new waiter
        assert sent == [{"token_ids": [1], "index": 0}] and not task.done()
        waker._flush()  # the flush the racing emit asked for
        waker.emit(outbox, {"token_ids": [2], "index": 0})
        waker._flush()
        waker.emit(outbox, END)
        waker._flush()
        return await asyncio.wait_for(task, 2), sent

    result, sent = asyncio.run(scenario())
    assert result == "ended"
    assert sent == [{"token_ids": [1], "index": 0}, {"token_ids": [2], "index": 0}]


async def test_the_asyncio_loop_ending_fails_its_trio_callers_instead_of_leaving_them_waiting():
    # A failure on the asyncio side ends the Trio side's waits on it: the worker's watcher of the serve future
    # then ends the worker (exit 1) instead of hanging.
    from trio_sidecar.dynamo.thread import LOOP_ENDED

    thread = AsyncioThread()
    await thread.start()
    outcome: list[BaseException] = []

    async def forever():
        await asyncio.sleep(3600)

    def die():
        raise SystemExit("the loop dies")

    async def call_forever():
        try:
            await thread.run(forever)
        except RuntimeError as exc:
            outcome.append(exc)

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call_forever)
                await trio.testing.wait_all_tasks_blocked()
                thread.call_soon(die)
            with pytest.raises(RuntimeError, match=LOOP_ENDED):
                await thread.run(forever)  # and a call after the end fails at once
    finally:
        await thread.stop()
    assert [str(exc) for exc in outcome] == [LOOP_ENDED]


# -- worker-side prefill completion (docs/dynamo.md#router-load-signals) -------------------------------------


class FirstTokenContext(FakeDynamoContext):
    """Records how many frames the push sender had sent at each ``notify_first_token()``."""

    def __init__(self, request_id: str, sender: FakeResponseSender) -> None:
        super().__init__(request_id)
        self.sender = sender
        self.frames_at_notify: list[int] = []

    def notify_first_token(self) -> None:
        super().notify_first_token()
        self.frames_at_notify.append(len(self.sender.frames))


def tokens_after_an_empty_chunk(nursery: trio.Nursery):
    """``Sidecar.submit`` for a request whose first output has no token (then three with one each); like the
    engine's request task, it calls ``ctx.on_first_token`` as the first tokens are produced."""

    def submit(request: dict, ctx, sink) -> None:
        async def run() -> None:
            for step, token_ids in enumerate(([], [5], [6], [7])):
                if step == 1:
                    ctx._notify_first_token()
                sink.chunk(Chunk({"token_ids": token_ids, "index": 0, "step": step}))  # "step": never merged
                await trio.lowlevel.checkpoint()
            sink.end(None, None)

        nursery.start_soon(run)

    return submit


@pytest.mark.parametrize("egress", ["pull", "push"])
@pytest.mark.parametrize("bound", [True, False])
async def test_a_bound_request_notifies_its_first_token_once_when_the_first_token_is_handed_over(
    loop_thread, egress, bound
):
    binds: list[tuple[str, dict]] = []

    def bind_context(context, request) -> bool:
        binds.append((context.id(), request))
        return bound

    bridge = RequestBridge(loop_thread, bind_context=bind_context)
    request = {"token_ids": [1], "routing": {"dp_rank": 0}}
    sender = FakeResponseSender()
    ctx = FirstTokenContext("ft", sender)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.run_dispatcher, tokens_after_an_empty_chunk(nursery))
        with trio.fail_after(10):
            if egress == "push":
                assert await loop_thread.run(push, bridge, request, ctx, sender) is None
                out = sender.frames
            else:
                out = await loop_thread.run(consume, bridge, request, ctx)
            await wait_idle(bridge)
        nursery.cancel_scope.cancel()

    async def loop_thread_id():
        return threading.get_ident()

    assert tokens_of(out) == [5, 6, 7]
    assert binds == [("ft", request)]
    if not bound:
        assert ctx.first_token_threads == []
        return
    assert ctx.first_token_threads == [await loop_thread.run(loop_thread_id)]
    if egress == "push":
        assert ctx.frames_at_notify[0] <= 1  # before the first token's frame
