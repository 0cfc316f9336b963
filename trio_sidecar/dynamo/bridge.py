"""Dynamo's endpoint handler over ``Sidecar.submit``, on one thread (docs/reference/worker.md#the-request-bridge).

Theory of operation
-------------------

Dynamo's runtime uses trio-asyncio's asyncio loop, which runs inside Trio (:mod:`.host`), so the Dynamo
handler and the Trio sidecar run on the same thread and exchange a request and its chunks by plain calls.

Per request (:meth:`RequestBridge.handler`, an async generator Dynamo's runtime drives on the loop):

1. the handler creates the request's ``GenerateContext`` and calls ``sidecar.submit(request, ctx, call)``
   at once (it starts the engine's request task; a refusal — conversion, admission, shutdown — is raised
   from the handler as Dynamo's typed exception, :mod:`.error_map`);
2. a watcher on Dynamo's ``context.async_killed_or_stopped()`` calls ``ctx.stop()``. The context exists
   before the watcher does, so a cancel that comes before the engine's request task has even started is
   never lost: the engine sees ``ctx`` stopped when the task starts;
3. the engine delivers the chunks to the request's :class:`_Call` (a ``ChunkSink``) as their messages are
   read, from the connection's reader task; the :class:`_Call` hands each to Dynamo right there (push
   egress, below) and ends the handler with the final chunk or the error;
4. if the runtime closes the handler first (the client went away), or the response stream is gone,
   ``ctx.stop()`` ends the request (an Abort is queued by the engine).

Egress: how output reaches Dynamo. Dynamo 1.6.1 has two paths, chosen per handler by its signature.

* Push (what Dynamo's TRT-LLM workers use, and what :meth:`RequestBridge.handler` declares with its
  ``response_sender`` parameter): the runtime advances the handler once per request, and
  ``response_sender.send(d)`` encodes ``d`` on the calling thread and queues the bytes on the request's
  bounded response channel (128 frames). ≈ 6 µs per item, like the native sidecar.
* Pull (callers without a sender, e.g. in-process callers): the handler yields each output dict.

``ResponseSender.send`` **blocks** its caller (with the GIL released) while the request's channel is full,
i.e. when its consumer stopped reading; on the loop that would stall every request. So a request's first
:data:`PUSH_INLINE_FRAMES` frames (fewer than the channel holds, so they can never block) are sent inline,
from the Trio task that read them; later ones by a Trio task of the bridge's (one per request, only while
it has frames queued) that sends each in a worker thread (``trio.to_thread``, daemon threads that Trio
starts on demand and retires when idle): a full channel parks that thread, never the loop, and never
another request's frames. The chunks that queue meanwhile go out merged (:mod:`.coalesce`), so a lagging
consumer pays Dynamo's per-item cost once per batch, not per token.

Lifetime: :meth:`RequestBridge.run` is the bridge's part of the worker's nursery tree: the requests' egress
tasks run in its nursery, and when it is cancelled every request still open ends at once with
``EngineShutdown("trio-sidecar is shutting down")`` (so does a request handed over later). Admission and drain
belong to the engine (``stop_admission``, ``wait_idle``, ``in_flight``, ``cancel_in_flight``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..errors import EngineShutdown, SidecarError
from ..protocol import token_chunk_dict
from ..tracecontext import TRACEPARENT, TRACESTATE, is_metadata_value
from .coalesce import take_merged
from .error_map import dynamo_exception

if TYPE_CHECKING:
    from ..api import GenerateContext
    from ..protocol import LLMEngineOutput

__all__ = [
    "PUSH_INLINE_FRAMES",
    "QUEUE_WARN_THRESHOLD",
    "RequestBridge",
    "SHUTTING_DOWN",
    "dynamo_exception",
]

LOGGER = logging.getLogger("trio_sidecar.dynamo.bridge")

SHUTTING_DOWN = "trio-sidecar is shutting down"
QUEUE_WARN_THRESHOLD = 1024
# Frames of one request sent inline (see "Egress" above). Dynamo 1.6.1 gives each push-egress request a
# response channel of 128 frames (RESPONSE_CHANNEL_DEPTH; `mpsc::channel(0x80)` in
# PythonPushEngine::generate) and ResponseSender.send blocks while it is full, so no send within a request's
# first 128 can block; later frames go through a worker thread.
PUSH_INLINE_FRAMES = 96
# At most this many requests' frames in worker threads at once (each parked on a stalled consumer holds one).
EGRESS_THREADS = 256

Output = dict[str, Any]


class DynamoContext(Protocol):
    """What the bridge uses of Dynamo's per-request ``Context``."""

    def id(self) -> str: ...

    def async_killed_or_stopped(self) -> Awaitable[object]: ...

    def notify_first_token(self) -> None: ...


class ResponseSender(Protocol):
    """Dynamo's push-egress ``ResponseSender``."""

    def send(self, output: Output) -> None: ...

    def close(self) -> None: ...


class Submit(Protocol):
    """``Sidecar.submit``: start a request whose chunks go to ``sink`` (synchronous; raises if not started)."""

    def __call__(self, request: dict[str, Any], ctx: GenerateContext, sink: _Call) -> None: ...


class _End:
    """The end of a request's queued output (its handler returns)."""

    def __repr__(self) -> str:
        return "<end of stream>"


END = _End()


class _Call:
    """One request between Dynamo's handler and the engine: the engine's ``ChunkSink`` for it.

    Push: outputs are sent inline while the window lasts and nothing is queued, else queued for the
    request's egress task; ``done`` resolves when the handler must return (or raise). Pull: outputs are
    queued and ``waiter`` wakes the parked handler.
    """

    __slots__ = ("_bridge", "request_id", "ctx", "sender", "items", "inline", "done", "waiter",
                 "pumping", "scheduled", "ended", "closed", "warned")

    def __init__(self, bridge: RequestBridge, request_id: str, ctx: GenerateContext,
                 sender: ResponseSender | None, done: asyncio.Future[None]) -> None:
        self._bridge = bridge
        self.request_id = request_id
        self.ctx = ctx
        self.sender = sender
        self.items: deque[Output | _End | BaseException] = deque()
        self.inline = bridge.push_inline_frames
        self.done = done
        self.waiter: asyncio.Future[None] | None = None
        self.pumping = False  # its egress task runs
        self.scheduled = False  # due in the bridge's next flush
        self.ended = False  # the engine called end()
        self.closed = False  # nothing more goes to Dynamo (finished, or the handler left)
        self.warned = False

    # -- the engine's ChunkSink ------------------------------------------------------------------------

    def chunk(self, chunk: LLMEngineOutput) -> None:
        self._put(chunk.to_dict())

    def tokens(self, token_ids: list[int], text: str) -> None:
        """``chunk(token_chunk(token_ids, text))`` without building the chunk: its dict directly (``text``
        always present, ``""`` included: see ``LLMEngineOutput``)."""
        self._put(token_chunk_dict(token_ids, text))

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None:
        """The request's last output, then its end; only the first call counts. Never raises."""
        if self.ended:
            return
        self.ended = True
        self._bridge._live.discard(self)
        try:
            if final is not None:
                self._put(final.to_dict())
            elif error is not None and not isinstance(error, SidecarError):
                LOGGER.error("request %s failed unexpectedly: %r", self.request_id, error)
        except Exception:  # noqa: BLE001 - the end must still go out
            LOGGER.exception("request %s: could not hand over its last output", self.request_id)
        self._put(END if final is not None or error is None else error)

    # -- delivery --------------------------------------------------------------------------------------

    def _put(self, out: Output | _End | BaseException) -> None:
        if self.closed:
            return
        sender = self.sender
        items = self.items
        if sender is None:
            items.append(out)
            self._warn_if_stalled()
            waiter = self.waiter
            if waiter is not None:
                self.waiter = None
                if not waiter.done():
                    waiter.set_result(None)
            return
        items.append(out)
        if self.pumping:
            self._warn_if_stalled()
        elif not self.scheduled:
            self.scheduled = True
            self._bridge._schedule(self)

    def flush(self) -> None:
        """Send what is queued (merged) inline while the window lasts; past it, start the egress task. Run by
        the bridge's flush, once per Trio batch that produced output for this request."""
        self.scheduled = False
        items = self.items
        sender = self.sender
        assert sender is not None
        while items and not self.closed and not self.pumping:
            head = items[0]
            if type(head) is not dict:
                items.popleft()
                self._finish(head)  # type: ignore[arg-type]  # (END or an error)
                return
            if not self.inline:
                self._bridge._start_egress(self)
                return
            out = take_merged(items)
            self.inline -= 1
            try:
                sender.send(out)
            except RuntimeError as exc:  # the response stream is closed: nobody reads it any more
                self._gone(exc)
            except Exception as exc:  # noqa: BLE001 - raised by the handler
                self._fail(exc)

    def _warn_if_stalled(self) -> None:
        if not self.warned and len(self.items) > QUEUE_WARN_THRESHOLD:
            self.warned = True
            LOGGER.warning("request %s: %d output chunks are queued for Dynamo; the consumer is stalled",
                           self.request_id, len(self.items))

    async def egress(self, limiter: trio.CapacityLimiter) -> None:
        """Send the queued outputs one at a time in a worker thread, merged (push, past the window)."""
        items = self.items
        sender = self.sender
        assert sender is not None
        try:
            while items and not self.closed:
                head = items[0]
                if type(head) is not dict:
                    items.popleft()
                    self._finish(head)  # type: ignore[arg-type]
                    return
                out = take_merged(items)
                try:
                    await trio.to_thread.run_sync(sender.send, out, limiter=limiter, abandon_on_cancel=True)
                except RuntimeError as exc:  # the response stream is closed
                    self._gone(exc)
                except Exception as exc:  # noqa: BLE001 - raised by the handler
                    self._fail(exc)
        finally:
            self.pumping = False
            if items and not self.closed:  # cancelled: the bridge is shutting down
                self.ctx.stop()
                self._finish(EngineShutdown(SHUTTING_DOWN))

    # -- endings ---------------------------------------------------------------------------------------

    def _finish(self, last: _End | BaseException) -> None:
        """The handler's end: return (``END``) or raise the error as Dynamo's typed exception."""
        self.closed = True
        self.items.clear()
        if last is END:
            if self.sender is not None:
                self.sender.close()  # never blocks: it only drops the channel's sending end
            self._resolve(None)
        else:
            assert isinstance(last, BaseException)
            self._resolve(dynamo_exception(last))

    def _gone(self, exc: RuntimeError) -> None:
        LOGGER.debug("request %s: %s", self.request_id, exc)
        self.closed = True
        self.items.clear()
        self.ctx.stop()
        self._resolve(None)

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        self.items.clear()
        self.ctx.stop()
        self._resolve(exc)

    def _resolve(self, error: BaseException | None) -> None:
        done = self.done
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def leave(self) -> None:
        """The handler is leaving: stop the request unless it already ended."""
        if not self.closed:
            self.closed = True
            self.items.clear()
            self.ctx.stop()
        if not self.done.done():
            self.done.cancel()

    def __repr__(self) -> str:
        return f"<_Call {self.request_id!r} queued={len(self.items)} ended={self.ended} closed={self.closed}>"


class RequestBridge:
    """Carries requests from Dynamo's handler to ``Sidecar.submit`` and their chunks back, on one thread.

    Args:
        submit: ``Sidecar.submit``.
        make_context: ``make_context(request_id, on_first_token) -> ctx``; by default
            :class:`trio_sidecar.api.GenerateContext`.
    """

    def __init__(
        self,
        submit: Submit,
        make_context: Callable[..., GenerateContext] | None = None,
    ) -> None:
        self._submit = submit
        self._make_context = make_context or _default_context
        self._nursery: trio.Nursery | None = None  # while run() runs
        self._live: set[_Call] = set()  # submitted, not ended yet: ended at once when run() ends
        self._limiter = trio.CapacityLimiter(EGRESS_THREADS)
        self._loop: asyncio.AbstractEventLoop | None = None  # the host loop (set by the first request)
        self._due: list[_Call] = []  # requests with output queued since the last flush
        self.push_inline_frames = PUSH_INLINE_FRAMES

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests until cancelled (their egress tasks run in here); then end every open request with
        ``EngineShutdown("trio-sidecar is shutting down")`` and refuse later ones the same way."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for call in list(self._live):
                call.ctx.stop()
                call.end(None, EngineShutdown(SHUTTING_DOWN))

    # -- the Dynamo handler (asyncio side of the same thread) -------------------------------------------

    def handler(self, request: dict[str, Any], context: DynamoContext,
                response_sender: ResponseSender | None = None) -> AsyncIterator[Output]:
        """The Dynamo endpoint handler: the request's async generator.

        Dynamo 1.6.1 serves a handler that declares a ``response_sender`` parameter on its *push egress*:
        the runtime passes a ``ResponseSender`` and advances the generator once per request (see "Egress"
        in the module docstring). Calls without a sender get an async generator that yields the outputs.
        """
        if response_sender is None:
            return self._pull(request, context)
        return self._push(request, context, response_sender)

    def _open(self, request: dict[str, Any], context: DynamoContext,
              sender: ResponseSender | None) -> tuple[_Call, asyncio.Future[object]]:
        """Submit the request and watch Dynamo's context for its cancellation."""
        if self._nursery is None:
            raise dynamo_exception(EngineShutdown(SHUTTING_DOWN))
        loop = self._loop = asyncio.get_running_loop()
        request_id = str(context.id())
        traceparent, tracestate = _trace_context(context)
        ctx = self._make_context(
            request_id, lambda: _notify_first_token(context), traceparent=traceparent, tracestate=tracestate
        )
        call = _Call(self, request_id, ctx, sender, loop.create_future())
        try:
            self._submit(request, ctx, call)
        except SidecarError as exc:
            translated = dynamo_exception(exc)
            if translated is exc:  # (no Dynamo installed)
                raise
            raise translated from exc
        except Exception:
            LOGGER.exception("request %s failed unexpectedly", request_id)
            raise
        if not call.ended:
            self._live.add(call)
        watcher = asyncio.ensure_future(context.async_killed_or_stopped())
        watcher.add_done_callback(lambda f: None if f.cancelled() else ctx.stop())
        return call, watcher

    async def _push(self, request: dict[str, Any], context: DynamoContext,
                    sender: ResponseSender) -> AsyncIterator[Output]:
        call, watcher = self._open(request, context, sender)
        try:
            await call.done
        finally:
            watcher.cancel()
            call.leave()
        if False:  # pragma: no cover - makes this an async generator, which the push egress requires
            yield {}

    async def _pull(self, request: dict[str, Any], context: DynamoContext) -> AsyncIterator[Output]:
        call, watcher = self._open(request, context, None)
        items = call.items
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not items:
                    call.waiter = loop.create_future()
                    await call.waiter
                    continue
                head = items[0]
                if head is END:
                    call.closed = True
                    return
                if isinstance(head, BaseException):
                    items.popleft()
                    call.closed = True
                    raise dynamo_exception(head)
                yield take_merged(items)
        finally:
            watcher.cancel()
            call.waiter = None
            call.leave()

    # -- Trio side ---------------------------------------------------------------------------------------

    def _schedule(self, call: _Call) -> None:
        """Flush ``call`` once the Trio tasks that are ready now have run: the chunks of one request that
        several reads deliver in one Trio batch go to Dynamo as one output (a plain ``call_soon``: the
        flush runs when trio-asyncio's loop task next runs, after the Trio tasks that are ready now)."""
        due = self._due
        due.append(call)
        if len(due) == 1:
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        due, self._due = self._due, []
        for call in due:
            call.flush()

    def _start_egress(self, call: _Call) -> None:
        nursery = self._nursery
        if nursery is None:  # shutting down: nothing sends any more
            call.ctx.stop()
            call._finish(EngineShutdown(SHUTTING_DOWN))
            return
        call.pumping = True
        nursery.start_soon(call.egress, self._limiter, name=f"dynamo-egress {call.request_id}")

    def __repr__(self) -> str:
        return f"<RequestBridge [{'serving' if self._nursery is not None else 'closed'} | {len(self._live)} open]>"


def _notify_first_token(context: DynamoContext) -> None:
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


def _default_context(
    request_id: str, on_first_token: Callable[[], None], *, traceparent: str | None, tracestate: str | None
) -> GenerateContext:
    from ..api import GenerateContext

    return GenerateContext(request_id, on_first_token=on_first_token, traceparent=traceparent, tracestate=tracestate)
