"""The asyncio-thread bridge between Dynamo's runtime and the Trio sidecar (docs/reference/worker.md#the-asyncio-thread-bridge).

Theory of operation
-------------------

Dynamo's Python bindings only work on asyncio, and every Dynamo object must be touched on the loop that
created it. Trio owns the process; one dedicated thread runs an asyncio loop that owns every Dynamo
object. The two sides talk only through non-blocking, thread-safe scheduling calls, so neither loop ever
blocks on the other:

* asyncio → Trio: ``trio_token.run_sync_soon(fn, *args)``. It raises ``trio.RunFinishedError`` once the
  Trio run is over, which the asyncio side catches.
* Trio → asyncio: ``loop.call_soon_threadsafe(fn, *args)``, or for a coroutine
  ``asyncio.run_coroutine_threadsafe``; Trio waits for the resulting future through a done-callback that
  sets a ``trio.Event`` via ``run_sync_soon`` (:meth:`.thread.AsyncioThread.run`).

Per request (:meth:`RequestBridge.handler`, on the asyncio thread):

1. an unbounded :class:`Outbox` (a deque) and an ``emit`` function that Trio calls to append to it
   (see "Wake-ups" below);
2. the request's ``GenerateContext`` (its id and trace context). It is created here and from then on only
   touched on the Trio thread, so it needs no lock;
3. the request is handed to Trio with ``run_sync_soon(bridge._dispatch, item)``;
4. a watcher on ``context.async_killed_or_stopped()`` calls ``ctx.stop()`` (via ``run_sync_soon``), which
   calls the request task's cancellation directly (its one listener): the stop reaches the task in one step;
5. the handler hands queued chunks to Dynamo (see "Egress"), raises a queued exception, and ends on the
   end sentinel;
6. if the runtime closes the generator before the end sentinel, or the response stream is gone,
   ``ctx.stop()`` is scheduled the same way.

``run_sync_soon`` callbacks run in FIFO order, so the hand-over always reaches Trio before any stop request
for the same request. A stop that comes before the request task exists (``run_dispatcher`` not running yet)
only marks the context stopped; the engine's ``submit`` subscribes the task to the context and finds it
stopped — a cancel that arrives before the Trio side starts the request is never lost.

First token: a request bound to a prefill-completion source (``bind_context``) gets one
``context.notify_first_token()``, from one place: the request task calls ``ctx.on_first_token`` when the
request's first tokens are converted, including the decode deferral's first token that the cancelled chunk
replaces (docs/reference/sidecar.md#decode-deferral). That callback queues the notification with
:meth:`Waker.call_soon`, so it rides the batch's one loop wake-up, runs ahead of the chunks that flush hands
to a parked handler, and runs even when the handler is gone (the deferral exists for a client that left).

Trio side: ``_dispatch`` (the ``run_sync_soon`` callback itself) calls ``sidecar.submit(request, ctx,
sink)``, which starts the engine's request task; there is no task per request on this side and no hand-over
between tasks. The engine delivers the chunks to the
request's :class:`_Sink` as their messages are read (from the connection's reader task:
``ResponseStream.listen``; those of messages read together at the end of their run, consecutive plain token
chunks as one), which emits ``chunk.to_dict()``; then the final chunk or the error (a
:class:`~trio_sidecar.core.errors.SidecarError` as an exception object), and always the end sentinel. A request
that ``submit`` refuses (conversion, admission) ends at once with its error.

Wake-ups: one ``call_soon_threadsafe`` per chunk (a self-pipe write and a loop wake-up each) cost about
30% of the Trio thread under load. So ``emit`` only appends to the request's deque; when the handler is
parked waiting for it, the parked future goes on a shared ready list, and one ``call_soon_threadsafe`` per
*batch* (scheduled only if none is pending) resolves every ready future on the loop. That call is made by
the dispatcher task (``_poke``), which runs after the Trio tasks that were ready with it: with several gRPC
connections, the reads that complete in one Trio scheduling batch share one loop wake-up (paced end to end:
~1 per request instead of ~3.4). The handshake needs
no lock under the GIL: the handler publishes its waiter *then* re-checks the deque; ``emit`` appends *then*
reads the waiter, so at least one of them sees the other. A stale wake-up of an already-resumed waiter is
harmless (``done()`` is checked).

Egress: how output reaches Dynamo. Dynamo 1.6.1 has two paths, chosen per handler by its signature.

* Pull (the default for Python handlers): the handler is an async generator and the runtime pulls each
  item with ``__anext__``: a tokio thread takes the GIL, schedules the step on this loop with
  ``call_soon_threadsafe`` (an ``asyncio.Task`` per item), waits for it, takes the GIL again to convert the
  item. Measured with a worker that does nothing else (``bench/e2e.py --ceiling``): ≈ 60 µs of CPU per
  item with asyncio's loop, ≈ 30 µs with uvloop, against ≈ 6 µs per item for the native Rust sidecar.
* Push (what Dynamo's TRT-LLM workers use): a handler that declares a ``response_sender`` parameter gets a
  ``ResponseSender``; the runtime advances its generator once per request, and ``response_sender.send(d)``
  encodes ``d`` on the calling thread under the GIL it already holds and queues the bytes on the request's
  bounded response channel (128 frames). ≈ 6 µs per item, like the native sidecar. :meth:`handler`
  declares the parameter, so the runtime serves it with push ("serving endpoint with push egress" in its
  log); calls without a sender (in-process callers) still get the pull generator.

``ResponseSender.send`` **blocks** its caller (with the GIL released) while the request's channel is full,
i.e. when its consumer stopped reading (a client that stops reading a long stream); on this loop that would
stall every request. So a request's first :data:`PUSH_INLINE_FRAMES` frames (fewer than the channel holds,
so they can never block) are sent inline on the loop, and later ones by daemon egress threads
(:class:`.egress.Egress`, started on demand), one frame of a request at a time: a full channel then only parks an
egress thread, never the loop, and never another request's frames. Chunks queued meanwhile are merged (below), so a request that is past its window
still pays one hand-off per batch, not per token.

Within the window the handler is not even resumed per batch: while it is parked, the loop's flush calls its
``drain`` (:class:`Outbox`), which sends the queued outputs right there and leaves the handler parked. The
handler only runs again for the end, an error, a failed send, or an output past its window (paced end to
end: the asyncio thread's CPU per completion fell by about a quarter).

Coalescing: when several plain token chunks of one request are already queued when the handler resumes,
they are handed over as one multi-token delta (:func:`.coalesce.take_merged`), so a lagging consumer pays Dynamo's
per-item cost once per batch instead of once per token. Without back-pressure every chunk goes as is.

Back-pressure: the per-request outbox is unbounded (chunks are small and vLLM's output rate is bounded);
a queue that grows past :data:`QUEUE_WARN_THRESHOLD` items means the consumer stalled, and is logged once
per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import attrs
import trio

from ..core.errors import EngineShutdown, SidecarError
from ..core.protocol import token_chunk_dict
from ..core.tracecontext import TRACEPARENT, TRACESTATE, is_metadata_value
from ..shell.context import GenerateContext
from .coalesce import take_merged
from .egress import Egress
from .error_map import dynamo_exception
from .thread import AsyncioThread
from .wakeup import Outbox, Waker

__all__ = [
    "RequestBridge",
    "RequestItem",
    "QUEUE_WARN_THRESHOLD",
    "SHUTTING_DOWN",
    "dynamo_exception",
]

LOGGER = logging.getLogger("trio_sidecar.dynamo.bridge")

QUEUE_WARN_THRESHOLD = 1024
# Frames of one request pushed from the loop itself ("Egress" above). Dynamo 1.6.1 gives each push-egress
# request a response channel of 128 frames (RESPONSE_CHANNEL_DEPTH; `mpsc::channel(0x80)` in
# PythonPushEngine::generate) and ResponseSender.send blocks while it is full, so no send within a request's
# first 128 can block; later frames go through the egress threads (egress.py).
PUSH_INLINE_FRAMES = 96
SHUTTING_DOWN = "trio-sidecar is shutting down"


class _End:
    """The end-of-stream sentinel (one per request, always emitted last)."""

    def __repr__(self) -> str:
        return "<end of stream>"


END = _End()


@attrs.frozen
class RequestItem:
    """What the asyncio handler hands to Trio for one request."""

    request: dict
    request_id: str
    emit: Callable[[Any], None]  # thread-safe; puts a chunk dict, an exception, or END
    ctx: GenerateContext  # created on the loop, used on the Trio thread only


class _Stream:
    """One request on the asyncio side: its outbox, stop request and cancellation watcher."""

    __slots__ = (
        "loop",
        "outbox",
        "request_id",
        "request_stop",
        "watcher",
        "merge",
        "ended",
        "warned",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox,
        request_id: str,
        request_stop: Callable[[], None],
        merge: bool = True,
    ) -> None:
        self.loop = loop
        self.merge = merge
        self.outbox = outbox
        self.request_id = request_id
        self.request_stop = request_stop
        self.watcher: asyncio.Future | None = None  # context.async_killed_or_stopped(), set by _open
        self.ended = False
        self.warned = False

    async def wait(self, drain: Callable[[], bool] | None = None) -> None:
        """Park until Trio emits (the waiter handshake in "Wake-ups" above); with ``drain`` (push), until an
        emit that ``drain`` cannot handle inline (see :class:`Outbox`)."""
        outbox = self.outbox
        waiter = self.loop.create_future()
        outbox.drain = drain
        outbox.waiter = waiter
        if outbox.items:  # emitted between the caller's check and publishing the waiter
            outbox.waiter = None
            # The emit may have queued this waiter for a flush: cancelled, that flush skips it instead of
            # draining for it and re-publishing it over the waiter this handler parks on next.
            waiter.cancel()
            return
        await waiter

    def take(self) -> Any:
        """The next output dict (queued plain token deltas merged into it), or END; raises a queued error."""
        items = self.outbox.items
        out = items[0]
        if not self.warned and len(items) > QUEUE_WARN_THRESHOLD:
            self.warned = True
            LOGGER.warning(
                "request %s: %d output chunks are queued for Dynamo; the consumer is stalled",
                self.request_id,
                len(items),
            )
        if out is END:
            items.popleft()
            self.ended = True
            return out
        if isinstance(out, BaseException):
            items.popleft()
            self.ended = True
            raise dynamo_exception(out)
        return take_merged(items) if self.merge else items.popleft()

    def close(self) -> None:
        """Leave the request: stop the Trio side unless it already ended."""
        self.outbox.waiter = None
        self.outbox.drain = None
        if self.watcher is not None:
            self.watcher.cancel()
        if not self.ended:
            self.request_stop()


class _Submit(Protocol):
    """``Sidecar.submit``: start a request whose chunks go to ``sink`` (synchronous; raises if not started)."""

    def __call__(self, request: dict, ctx: Any, sink: Any) -> None: ...


class _Sink:
    """One request's :class:`~trio_sidecar.shell.engine.ChunkSink`: chunk dicts onto its outbox (Trio thread)."""

    __slots__ = ("_bridge", "_item", "ended")

    def __init__(self, bridge: RequestBridge, item: RequestItem) -> None:
        self._bridge = bridge
        self._item = item
        self.ended = False

    def chunk(self, chunk: Any) -> None:
        if not self.ended:
            self._item.emit(chunk.to_dict())

    def tokens(self, token_ids: list[int], text: str) -> None:
        """``chunk(token_chunk(token_ids, text))`` without building the chunk: its dict directly (``text``
        always present, ``""`` included: see ``LLMEngineOutput``)."""
        if not self.ended:
            self._item.emit(token_chunk_dict(token_ids, text))

    def stop_and_end(self, error: BaseException) -> None:
        """Stop the request (its ``ctx.stop()``) and end it at once with ``error`` (the dispatcher's end)."""
        self._item.ctx.stop()
        self.end(None, error)

    def end(self, final: Any, error: BaseException | None) -> None:
        """The request's last output, then the end sentinel; only the first call counts. Never raises."""
        if self.ended:
            return
        self.ended = True
        item = self._item
        try:
            if final is not None:
                item.emit(final.to_dict())
            elif error is not None:
                if not isinstance(error, SidecarError):
                    LOGGER.error("request %s failed unexpectedly: %r", item.request_id, error)
                item.emit(error)
        except Exception:  # noqa: BLE001 - the end sentinel must still go out
            LOGGER.exception("request %s: could not hand over its last output", item.request_id)
        finally:
            item.emit(END)
            self._bridge._finished(item)


class RequestBridge:
    """Carries requests from Dynamo's handler (asyncio thread) to Trio request tasks and chunks back.

    Args:
        thread: the running :class:`AsyncioThread`.
        bind_context: ``bind_context(context, request) -> bool``, called on the asyncio thread for every
            request before it is handed to Trio (the worker binds the request to its prefill-completion
            source, :mod:`.prefill_completion`); when it returns True, ``context.notify_first_token()`` is
            called once, on the loop, when the request's first tokens are converted ("First token" above).
    """

    def __init__(
        self,
        thread: AsyncioThread,
        bind_context: Callable[[Any, dict], bool] | None = None,
        *,
        merge: bool = True,
    ) -> None:
        self._thread = thread
        #: Queued token deltas go to Dynamo as one (``take_merged``); false: one output per chunk queued.
        self.merge = merge
        self._bind_context = bind_context
        self._submit: _Submit | None = None  # set while run_dispatcher() runs
        self._dispatcher_done = False  # run_dispatcher() ended: requests handed over now are refused
        self._pending: list[RequestItem] = []  # handed over before run_dispatcher() ran
        self._sinks: dict[str, _Sink] = {}  # request id -> its sink (the one routing table), while in flight
        self._flusher: Any = None  # the dispatcher task, while parked waiting for a poke
        self._wake_due = False  # poked: the dispatcher wakes the loop
        self.completed = 0
        self._waker: Waker | None = None  # created on the loop by the first request
        self._egress: Egress | None = None  # created on the loop by the first push request past its window
        self.push_inline_frames = PUSH_INLINE_FRAMES

    # -- asyncio side ----------------------------------------------------------------------------------

    def handler(self, request: dict, context: Any = None, response_sender: Any = None):
        """The Dynamo endpoint handler: returns the request's async generator (run on the asyncio thread).

        Dynamo 1.6.1 serves a handler that declares a ``response_sender`` parameter on its *push egress*
        (the path of its own TRT-LLM workers): the runtime passes a ``ResponseSender`` and advances the
        generator once per request; each output dict is handed over with ``response_sender.send`` under the
        GIL the loop already holds (see "Egress" in the module docstring). Calls without a sender (the pull
        egress, e.g. in-process callers) get an async generator that yields the output dicts.
        """
        if response_sender is None:
            return self._pull(request, context)
        return self._push(request, context, response_sender)

    def _open(self, request: dict, context: Any) -> _Stream:
        """Hand the request to Trio and watch for its cancellation (on the asyncio thread)."""
        loop = asyncio.get_running_loop()
        waker = self._waker
        if waker is None:
            waker = self._waker = Waker(loop, self._poke)
        outbox = Outbox()
        request_id = str(context.id())
        bound = self._bind_context is not None and self._bind_context(context, request)
        token = self._thread._token
        assert token is not None
        traceparent, tracestate = _trace_context(context)  # (values gRPC metadata can carry: never raises)

        on_first_token = partial(waker.call_soon, _notify_first_token, context) if bound else None  # (Trio thread)
        ctx = GenerateContext(request_id, on_first_token=on_first_token, traceparent=traceparent, tracestate=tracestate)

        def emit(item: Any) -> None:
            waker.emit(outbox, item)

        def request_stop() -> None:
            try:
                token.run_sync_soon(ctx.stop)
            except trio.RunFinishedError:
                pass

        stream = _Stream(loop, outbox, request_id, request_stop, self.merge)
        try:
            token.run_sync_soon(self._dispatch, RequestItem(request, request_id, emit, ctx))
        except trio.RunFinishedError:
            raise dynamo_exception(EngineShutdown(SHUTTING_DOWN)) from None
        watcher = stream.watcher = asyncio.ensure_future(context.async_killed_or_stopped())
        watcher.add_done_callback(lambda f: None if f.cancelled() else request_stop())
        return stream

    async def _pull(self, request: dict, context: Any):
        stream = self._open(request, context)
        items = stream.outbox.items
        try:
            while True:
                if not items:
                    await stream.wait()
                    continue
                out = stream.take()
                if out is END:
                    return
                yield out
        finally:
            stream.close()

    async def _push(self, request: dict, context: Any, sender: Any):
        stream = self._open(request, context)
        items = stream.outbox.items
        send = sender.send
        inline = self.push_inline_frames
        failed: Exception | None = None

        def drain() -> bool:
            """Send the queued outputs inline (on the loop) while the window lasts; True when the handler must
            take over: the end sentinel or an error is next, the window is used up, or a send failed. Called
            by the handler and, while it is parked, by the loop's flush (no task step per wake-up)."""
            nonlocal inline, failed
            if failed is not None:  # (a send that failed during a flush: the handler deals with it first)
                return True
            while items:
                head = items[0]
                if not inline or head is END or isinstance(head, BaseException):
                    return True
                out = stream.take()
                inline -= 1
                try:
                    send(out)
                except Exception as exc:  # noqa: BLE001 - raised by the handler, outside the flush
                    failed = exc
                    return True
            return False

        try:
            while True:
                if not drain():
                    await stream.wait(drain)
                    continue
                if failed is not None:
                    if isinstance(failed, RuntimeError):  # the response stream is closed: nobody reads it any more
                        LOGGER.debug("request %s: %s", stream.request_id, failed)
                        return
                    raise failed
                out = stream.take()  # the end, an error (raised), or an output past the window
                if out is END:
                    sender.close()  # never blocks: it only drops the channel's sending end
                    return
                egress = self._egress
                if egress is None:
                    egress = self._egress = Egress(stream.loop)
                try:
                    await egress.send(send, out)
                except RuntimeError as exc:  # the response stream is closed: nobody reads this request any more
                    LOGGER.debug("request %s: %s", stream.request_id, exc)
                    return
        finally:
            stream.close()
        if False:  # pragma: no cover - makes this an async generator, which the push egress requires
            yield

    # -- Trio side -------------------------------------------------------------------------------------

    def _dispatch(self, item: RequestItem) -> None:
        """Start a handed-over request (Trio thread, a ``run_sync_soon`` callback: never raises)."""
        if self._submit is None and not self._dispatcher_done:
            self._pending.append(item)  # before run_dispatcher(): started when it runs
            return
        sink = _Sink(self, item)
        if self._submit is None:  # after run_dispatcher() ended
            sink.end(None, EngineShutdown(SHUTTING_DOWN))
            return
        self._sinks[item.request_id] = sink
        try:
            self._submit(item.request, item.ctx, sink)
        except SidecarError as exc:
            sink.end(None, exc)
        except Exception as exc:  # noqa: BLE001 - the frontend turns it into HTTP 500
            LOGGER.exception("request %s failed unexpectedly", item.request_id)
            sink.end(None, exc)

    def _poke(self) -> None:
        """Wake the loop (``Waker.wake_loop``) once the Trio tasks that are ready now have run (Trio thread).

        Several connections' reads often complete in one Trio scheduling batch (vLLM answers all its
        streams at once); their emits then cost one ``call_soon_threadsafe`` (an eventfd write and a loop
        wake-up) instead of one each. Without a running dispatcher, the loop is woken at once.
        """
        if self._submit is None:
            self._wake_loop()
            return
        self._wake_due = True
        task = self._flusher
        if task is not None:
            self._flusher = None
            trio.lowlevel.reschedule(task)

    def _wake_loop(self) -> None:
        self._wake_due = False
        assert self._waker is not None  # (created with the first request, before anything is emitted)
        self._waker.wake_loop()

    def _unpark(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        self._flusher = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _finished(self, item: RequestItem) -> None:
        if self._sinks.pop(item.request_id, None) is not None:
            self.completed += 1

    @property
    def in_flight(self) -> int:
        """Handed-over requests whose sink has not ended (the engine's ``in_flight`` is what drains wait for)."""
        return len(self._sinks)

    async def run_dispatcher(self, submit: _Submit) -> None:
        """Start every handed-over request with ``submit`` (``Sidecar.submit``), until cancelled.

        Requests are started straight from the ``run_sync_soon`` callback that hands them over (no task of
        their own on this side: the engine's request task delivers their chunks to a :class:`_Sink`); those
        handed over before this runs are started now. When cancelled, every request still in flight gets
        stop requested and ends at once with ``EngineShutdown("trio-sidecar is shutting down")``, and so does
        any request handed over later.
        """
        self._submit = submit
        pending, self._pending = self._pending, []
        for item in pending:
            self._dispatch(item)
        try:
            while True:  # the loop wake-ups, deferred by _poke
                if self._wake_due:
                    self._wake_loop()
                self._flusher = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._unpark)
        finally:
            self._submit = None
            self._dispatcher_done = True
            self._flusher = None
            if self._wake_due:
                self._wake_loop()
            for sink in list(self._sinks.values()):
                sink.stop_and_end(EngineShutdown(SHUTTING_DOWN))

    def __repr__(self) -> str:
        return f"<RequestBridge [{self.in_flight} in flight, {self.completed} completed]>"


def _notify_first_token(context: Any) -> None:
    try:
        context.notify_first_token()
    except Exception:  # noqa: BLE001 - a best-effort signal to Dynamo
        LOGGER.debug("notify_first_token failed", exc_info=True)


def _trace_context(context: Any) -> tuple[str | None, str | None]:
    """The request's W3C ``traceparent``/``tracestate`` from Dynamo's ``context.trace_headers()`` (``None``
    without a trace context; docs/reference/worker.md#trace-context). A value gRPC metadata cannot carry is
    dropped (tracing must not fail a request)."""
    trace_headers = getattr(context, "trace_headers", None)
    if trace_headers is None:  # (a context without the 1.6.1 tracing surface)
        return None, None
    try:
        headers = trace_headers()
    except Exception:  # noqa: BLE001 - tracing is best effort
        LOGGER.debug("context.trace_headers() failed", exc_info=True)
        return None, None
    if not headers:
        return None, None
    traceparent = headers.get(TRACEPARENT)
    if not traceparent or not is_metadata_value(traceparent):
        return None, None
    tracestate = headers.get(TRACESTATE)
    if tracestate is not None and not is_metadata_value(tracestate):
        tracestate = None
    return traceparent, tracestate
