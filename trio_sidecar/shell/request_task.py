"""One in-flight request: its task, its cancellation and its delivery (docs/reference/sidecar.md#cancellation,
docs/reference/sidecar.md#decode-deferral, docs/reference/sidecar.md#stream-level-rules).

Theory of operation
-------------------
Every in-flight request is a :class:`RequestTask` run in the sidecar's nursery (never in the caller's
scope). It opens ``GenerateStream`` and listens to it (``ResponseStream.listen``): each message goes through
the pure ``convert.batch.BatchBuilder`` as the connection's reader task receives it, and at the end of each
run of messages read together their chunks go to the request's :class:`RunSink` at once, so a token costs no
task switch. The task itself only waits for the end, then calls ``sink.end`` with the final chunk (terminal
or cancelled) or the error. There is one such path; the two faces of the engine are sinks:

* ``submit()`` wraps the caller's ``ChunkSink`` in :class:`MergingSink` (consecutive plain token chunks merged
  into one ``tokens`` call, ``convert.batch.deliver_items``); it never pauses;
* ``generate()`` uses ``stream.ChunkStream``, which queues the runs for an async iterator and *pauses* the
  request (``run`` returns True) while the caller has not taken the previous run: the task stops listening
  (HTTP/2 flow control holds the rest of the stream, unacknowledged) until ``wait_taken`` returns.

One cancel scope (``RequestTask.scope``) wraps the task's work; two signals cancel it:

* engine shutdown (``cancel_shutdown``) interrupts every phase in every mode;
* the client's cancellation (``client_cancel``: ``ctx.stop()``, or the ``generate()`` caller leaving or
  being cancelled). In aggregated and prefill modes it cancels at once. In decode mode
  (docs/reference/sidecar.md#decode-deferral) a cancellation that arrives before the KV transfer completed is
  only *recorded* (``request_cancelled``); the task keeps reading until a response completes the transfer,
  then ends with the cancelled chunk instead of that response's chunk and drops the stream.

Races are biased: the cancellation state is checked before the open and before each message's conversion.
Whenever the task abandons an opened stream before the server ended it, it queues the request id for the
abort sender (``abort.AbortSender``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..core.convert.batch import END, WARN_ERROR_AFTER_CANCEL, BatchBuilder, Ending, deliver_items
from ..core.convert.request import BuiltRequest
from ..core.convert.response import ResponseState
from ..core.errors import SidecarError
from ..core.protocol import LLMEngineOutput
from ..core.stats import SidecarStats
from ..transport import ResponseStream
from .context import ChunkSink, GenerateContext
from .pool import ChannelPool

if TYPE_CHECKING:  # (imported only when tracing is on: docs/reference/sidecar.md#opentelemetry-span)
    from .otel import RequestTracing

__all__ = ["GENERATE_STREAM", "MergingSink", "RequestTask", "RunSink"]

LOGGER = logging.getLogger("trio_sidecar.engine")

GENERATE_STREAM = "/vllm.Inference/GenerateStream"


class RunSink(Protocol):
    """Where a request task delivers its output (the engine's one delivery interface).

    ``run(items)`` gets the chunks of one run of messages read together, as ``BatchBuilder.take_items``
    holds them (called in the connection's reader task or the request task; must not block, await or
    raise); it returns True to pause the request: the task stops reading until ``await wait_taken()``
    returns. ``cancelled()`` says the request is being cancelled (client or shutdown; it may come more
    than once): chunks not taken yet are not wanted. ``end`` is called exactly once, last (see
    ``ChunkSink.end``).
    """

    def run(self, items: list[Any]) -> bool: ...

    async def wait_taken(self) -> None: ...

    def cancelled(self) -> None: ...

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None: ...


class MergingSink:
    """``submit()``'s :class:`RunSink`: every run to a :class:`ChunkSink`, plain token chunks merged
    (``deliver_items``) unless ``merge`` is false; never pauses."""

    __slots__ = ("_chunk", "_merge", "_tokens", "end")

    def __init__(self, sink: ChunkSink, *, merge: bool = True) -> None:
        self._chunk = sink.chunk
        self._tokens = sink.tokens
        self._merge = merge
        self.end = sink.end

    def run(self, items: list[Any]) -> bool:
        deliver_items(items, self._tokens, self._chunk, merge=self._merge)
        return False

    async def wait_taken(self) -> None:  # pragma: no cover - run() never pauses
        raise AssertionError("a MergingSink never pauses")

    def cancelled(self) -> None:
        pass  # (every chunk was delivered as it was read)


@attrs.define(eq=False)
class RequestTask:
    """One request's state, shared by its task, its cancellation signals and its sink."""

    request_id: str
    ctx: GenerateContext
    state: ResponseState  # the conversion state (usage included); ``builder`` drives it
    builder: BatchBuilder  # decides what the task does with each message
    built: BuiltRequest
    decode: bool
    sink: RunSink
    stats: SidecarStats  # the engine's: time to first token, decode deferrals
    started_at: float  # ``time.perf_counter()`` when the engine accepted the request
    #: Cancelled by the client's cancellation or by engine shutdown (see the module docstring).
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    opened: trio.Event = attrs.field(factory=trio.Event)  # the open finished (either way)
    ended: trio.Event = attrs.field(factory=trio.Event)  # the engine stopped counting it and ``end`` ran
    done: bool = False  # the task ended (its outcome below is final)
    open_error: BaseException | None = None
    final: LLMEngineOutput | None = None
    error: BaseException | None = None
    request_cancelled: bool = False  # decode: client cancellation recorded, waiting for the transfer
    #: The scope was cancelled (it has no deadline, so only ``client_cancel``/``cancel_shutdown`` cancel
    #: it); a plain flag, read once per message (``CancelScope.cancel_called`` reads the clock).
    cancelling: bool = False
    streamed: bool = False  # the stream opened: vLLM received the request
    first_token_at: float = 0.0  # ``time.perf_counter()`` when the first tokens were delivered
    first_tokens: int = 0  # how many were delivered then (0: none yet)

    def client_cancel(self) -> None:
        """The client's cancellation signal (docs/reference/sidecar.md#cancellation-signals): immediate, or
        deferred in decode mode (docs/reference/sidecar.md#decode-deferral)."""
        if self.done:
            return
        if self.decode and not self.builder.transfer_completed:
            if not self.request_cancelled:
                self.stats.decode_deferrals += 1
            self.request_cancelled = True
        else:
            self.cancelling = True
            self.scope.cancel()
            self.sink.cancelled()

    def cancel_shutdown(self) -> None:
        """Engine shutdown: interrupts every phase in every mode."""
        self.cancelling = True
        self.scope.cancel()
        self.sink.cancelled()

    async def run(
        self, pool: ChannelPool, queue_abort: Callable[[str], None] | None, tracing: RequestTracing | None = None
    ) -> None:
        """Open, read and end the stream; sets ``final`` or ``error``/``open_error`` (never raises but
        ``Cancelled`` of an enclosing scope). ``sink.end`` is left to the caller (the engine first stops
        counting the request). ``tracing``: the sidecar's span for a traced request
        (docs/reference/sidecar.md#opentelemetry-span); ``None``: off."""
        sent = False  # the request left for the server
        server_ended = False  # terminal, EOF, a status, or a lost connection: no Abort needed
        ctx = self.ctx
        span = (
            None
            if tracing is None or not ctx.trace_metadata
            else tracing.start(self.request_id, self.built, ctx.traceparent, ctx.tracestate)
        )
        try:
            with self.scope:
                if not self.cancelling:
                    channel = await pool.channel("GenerateStream")
                    await trio.lowlevel.checkpoint_if_cancelled()  # biased
                    sent = True
                    metadata = self.built.metadata
                    if self.ctx.trace_metadata:  # docs/reference/sidecar.md#trace-context
                        metadata += self.ctx.trace_metadata if span is None else span.metadata
                    # the pool is the one edge for gRPC errors: a transport RpcError leaving the block is
                    # raised as the SidecarError status_to_error makes of it
                    async with pool.stream(
                        "GenerateStream",
                        GENERATE_STREAM,
                        self.built.message,
                        None,  # serialized messages: the builder parses only those it has to
                        metadata=metadata,
                        channel=channel,
                    ) as stream:
                        self.streamed = True
                        self.opened.set()
                        server_ended = await self._listen(stream)
        except SidecarError as exc:
            server_ended = True
            self._fail(exc)
        except Exception as exc:
            LOGGER.exception("unexpected failure in request %s", self.request_id)
            server_ended = False
            self._fail(exc)
        finally:
            if self.final is None and self.error is None and self.open_error is None:
                # Cancelled (client or shutdown) before the server ended the stream.
                self.final = self.state.cancelled_chunk()
            if sent and not server_ended and queue_abort is not None:
                queue_abort(self.request_id)
            self.done = True
            self.opened.set()
            self.ctx._unsubscribe(self.client_cancel)
            if span is not None:
                final = self.final
                span.end(
                    prompt_tokens=self.state.prompt_tokens,
                    completion_tokens=self.state.reported_completion_tokens(),
                    finish_reason=final.finish_reason if self.error is None and final is not None else None,
                    error=self.error or self.open_error,
                )

    def end(self) -> None:
        """Hand the outcome to the sink (once, after :meth:`run`)."""
        final = self.final
        try:
            self.sink.end(final, None if final is not None else self.error or self.open_error)
        except Exception:  # a sink must not raise; one that does must not take the engine down
            LOGGER.exception("the sink of request %s failed at its end", self.request_id)

    def _fail(self, exc: BaseException) -> None:
        if not self.opened.is_set():
            self.open_error = exc
        elif self.request_cancelled and not self.cancelling:
            LOGGER.warning(WARN_ERROR_AFTER_CANCEL)
            self.final = self.state.cancelled_chunk()
        else:
            self.error = exc

    async def _listen(self, stream: ResponseStream) -> bool:
        """Each message goes through ``builder`` as the connection's reader receives it, and the chunks of
        the messages read together go to the sink at once, at the end of their run (``listen``'s ``flush``);
        this task waits for the end, or for the sink to take a run it paused on. Returns whether the
        *server* ended the stream.

        Converted and delivered stay equal for the cancellation's usage: a run is converted and delivered
        in one go of the reader (no checkpoint between them), and the terminal message delivers the chunks
        before it at once.
        """
        builder = self.builder
        add = builder.add
        take_items = builder.take_items
        sink = self.sink
        run = sink.run
        failure: list[BaseException] = []
        # Time to first token (docs/observability.md): the first run that converted a token takes the
        # time; every later run pays one test of a flag. (The inter-token latency is taken once per request,
        # at its end: no clock read per run.)
        state = self.state
        waiting_first = True

        def deliver() -> bool:  # never raises; True: stop listening (a failure, or the sink paused)
            nonlocal waiting_first
            try:
                if waiting_first and state.completion_tokens:
                    waiting_first = False
                    self._first_tokens_delivered()
                items = take_items()
                if items:
                    return run(items)
            except Exception as exc:  # a bug: reported by this task
                failure.append(exc)
                return True
            return False

        def on_message(data: bytes) -> bool:  # reader task (or this one): never awaits, never raises
            if self.cancelling:  # the scope is cancelled: this task ends at its next checkpoint
                return True
            try:
                step = add(data, self.request_cancelled)
            except Exception as exc:  # a bug: reported by this task
                failure.append(exc)
                deliver()  # what the run converted before it
                return True
            if step is END:
                deliver()
                return True
            return False

        while True:
            stopped = await stream.listen(on_message, deliver)
            if failure:
                raise failure[0]
            ending = builder.ending
            if stopped and ending is not None:
                # Applied even if a cancellation came after the listener converted the ending message: its
                # tokens are counted already, so the sink gets that message's chunk (or error) as the last one.
                return self._end(ending)
            if self.cancelling:
                await trio.lowlevel.checkpoint()  # raises Cancelled: the scope was cancelled
            if not stopped:
                return self._end(builder.eof(self.request_cancelled))
            await sink.wait_taken()  # the sink paused: listen again once it took the runs it holds

    def _first_tokens_delivered(self) -> None:
        now = time.perf_counter()
        self.first_token_at = now
        self.first_tokens = self.state.completion_tokens
        self.stats.ttft.observe(now - self.started_at)
        # The one first-token notification (the worker's ``notify_first_token()``), also when the decode
        # deferral replaces the first token's chunk by the cancelled chunk: its tokens are counted already.
        self.ctx._notify_first_token()

    def _end(self, ending: Ending) -> bool:
        """Apply the builder's ending; returns whether the server ended the stream."""
        if ending.warning is not None:
            LOGGER.warning(ending.warning)
        if ending.error is not None:
            self.error = ending.error
        else:
            self.final = ending.final
        return ending.server_ended
