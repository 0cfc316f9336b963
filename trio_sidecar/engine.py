"""The sidecar engine: start / generate / cleanup, cancellation and the abort sender (docs/reference/sidecar.md#start-phase,
docs/reference/sidecar.md#stream-level-rules, docs/reference/sidecar.md#lifecycle, docs/reference/sidecar.md#cancellation).

Theory of operation
-------------------
Every in-flight request is a *request task* in the sidecar's nursery (docs/reference/sidecar.md#decode-deferral), never in the
caller's scope. The caller talks to it through:

* a rendezvous hand-off carrying the ordinary chunks in batches (``_Handoff``: a zero-size memory channel
  for one sender and one receiver). A batch holds the chunks of the messages the transport had already
  received (converted without awaiting, ``ResponseStream.next_buffered``), so one hand-off — a task switch
  each way — serves several tokens; ``_ChunkStream`` returns them one per ``__anext__``, and drops the rest
  of a batch once the request is cancelled (the cancelled chunk's usage then counts only the chunks
  returned). The task is never more than one batch of already-received messages ahead of the caller, and
  backpressure reaches HTTP/2 flow control. What to do with each message is decided by the pure
  ``convert.batch.BatchBuilder``; ``_pump`` only does the awaits;
* a *final slot* (``_Request.final`` / ``_Request.error``) read after the channel closes: the terminal
  chunk, the cancelled chunk, or the stream error. Final items never block the task, so engine shutdown
  cannot hang on a caller that stopped reading.

:meth:`SidecarEngine.submit` is the same request task for a consumer that never makes it wait (the Dynamo
bridge queues every chunk for its asyncio thread): instead of the hand-off, a ``ChunkSink``. ``_listen``
replaces ``_pump``: the builder runs in a callback that ``ResponseStream.listen`` calls from the connection's
reader task as each message arrives, and at the end of each run of messages read together their chunks go
straight to the sink (consecutive plain token chunks merged into one), so a token costs no task switch at
all; the request task only waits for the end, then calls ``sink.end`` with the final slot. Cancellation,
the decode deferral and Abort are the same code as for ``generate()``.

One cancel scope (``_Request.scope``) wraps the task's work; two signals cancel it:

* engine shutdown (:meth:`SidecarEngine.cleanup`, ``cancel_shutdown``) interrupts every phase in every mode;
* the client's cancellation (``ctx.stop()``, the caller leaving the ``generate()`` block, or the caller's
  own scope being cancelled, ``client_cancel``). In aggregated and prefill modes it cancels at once. In
  decode mode (docs/reference/sidecar.md#decode-deferral) a cancellation that arrives before the KV transfer completed is only *recorded*
  (``request_cancelled``); the task keeps reading until a response completes the transfer
  (``outputs.num_tokens > 0`` or ``finish_info``), then yields the cancelled chunk instead of that
  response's chunk and drops the stream.

Both end the task the same way (cancelled chunk, Abort if the server had not ended the stream), so one
scope serves both: a scope costs an enter and an exit per request.

Races are biased: the cancellation state is checked before each await of the open or of the next message.

Whenever the task abandons an opened ``GenerateStream`` before the server ended it (terminal, EOF or a
status), it queues the request id for the *abort sender* (docs/reference/sidecar.md#abort-after-abandoning-a-stream), which batches ids into best-effort
``Control.Abort`` calls.
"""

from __future__ import annotations

import enum
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs
import trio
from outcome import Error as _Error
from outcome import Value as _Value
from trio.lowlevel import Abort as _Abort
from trio.lowlevel import cancel_shielded_checkpoint as _cancel_shielded_checkpoint
from trio.lowlevel import checkpoint_if_cancelled as _checkpoint_if_cancelled
from trio.lowlevel import current_task as _current_task
from trio.lowlevel import reschedule as _reschedule
from trio.lowlevel import wait_task_rescheduled as _wait_task_rescheduled

from ._proto.vllm import control_pb2
from .config import DisaggregationMode, SidecarConfig, validate_sidecar_config
from .convert.batch import END, MORE, WARN_ERROR_AFTER_CANCEL, BatchBuilder, ChunkBatch, Ending, deliver_items
from .convert.request import build_generate_request
from .convert.response import ResponseState
from .discovery import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    discover_model,
    fetch_kv_event_sources,
    wait_for_services,
)
from .endpoint import GrpcEndpoint
from .errors import EngineShutdown, SidecarError, status_to_error
from .model import DiscoveredModel, EngineConfig, engine_config, ensure_startup_compatible
from .pool import ChannelPool
from .protocol import LLMEngineOutput, PreprocessedRequest, structure_request
from .transport import RpcError

__all__ = ["ChunkSink", "GenerateContext", "SidecarEngine", "GENERATE_STREAM", "ABORT", "ABORT_FLUSH_GRACE"]

LOGGER = logging.getLogger("trio_sidecar.engine")

_ABORT_SUCCEEDED = _Abort.SUCCEEDED

GENERATE_STREAM = "/vllm.Inference/GenerateStream"
ABORT = "/vllm.Control/Abort"

#: docs/reference/sidecar.md#abort-after-abandoning-a-stream: on cleanup, pending Abort ids are flushed for at most this long (shielded).
ABORT_FLUSH_GRACE = 5.0

NOT_STARTED = "vLLM sidecar is not started"
ALREADY_STARTED = "vLLM sidecar has already started"

# (WARN_*_AFTER_CANCEL: convert/batch.py, where those endings are decided)


class GenerateContext:
    """Per-request context of the embedded API (docs/reference/sidecar.md#embedded-api): the request id and the client's cancellation signal.

    Args:
        request_id: sent as ``GenerateRequest.request_id``; empty → a fresh UUID4 string.
        on_first_token: called where upstream calls ``notify_first_token()`` (decode deferral, docs/reference/sidecar.md#decode-deferral).

    ``stop()`` may be called from any Trio task of the same run, before or during ``generate()``.
    """

    def __init__(self, request_id: str = "", *, on_first_token: Callable[[], None] | None = None) -> None:
        self.request_id = request_id
        self.on_first_token = on_first_token
        self._stopped = trio.Event()
        self._listeners: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"<GenerateContext {self.request_id!r}{' stopped' if self.stopped else ''}>"

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the request to end with a cancelled chunk (decode mode defers it, docs/reference/sidecar.md#decode-deferral). Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for listener in list(self._listeners):
            listener()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _notify_first_token(self) -> None:
        if self.on_first_token is not None:
            self.on_first_token()

    def _subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)
        if self.stopped:
            listener()

    def _unsubscribe(self, listener: Callable[[], None]) -> None:
        try:
            self._listeners.remove(listener)
        except ValueError:
            pass


class ChunkSink(Protocol):
    """Where :meth:`SidecarEngine.submit` delivers a request's output (Trio thread; must not block or raise,
    and should be quick: ``chunk``/``tokens`` usually run in the connection's reader task, ahead of the
    other streams on that connection).

    ``chunk`` (or, for a chunk of token ids and text only, ``tokens``) gets every chunk as soon as its
    message is read, from whichever task read it (the connection's reader or the request task); plain token
    chunks of messages read together come as one ``tokens`` call (ids in order, texts concatenated); ``end`` is
    called exactly once, last: with the final chunk (terminal or cancelled) or the error (a
    :class:`~trio_sidecar.errors.SidecarError`, or an unexpected exception), the other ``None``. An
    exception from ``chunk``/``tokens`` fails the request like a bug in the engine (logged, ``end`` with the
    error); one from ``end`` is logged.
    """

    def chunk(self, chunk: LLMEngineOutput) -> None: ...

    def tokens(self, token_ids: list[int], text: str) -> None:
        """A plain token chunk (the common one): the same as ``chunk(token_chunk(token_ids, text))``;
        ``token_ids`` is a fresh list the sink may keep; ``text`` is ``""`` when vLLM sent none."""

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None: ...


class _Handoff:
    """A rendezvous hand-off of chunks from one request task to one consumer (``open_memory_channel(0)``'s
    semantics for one sender and one receiver, without its per-item bookkeeping).

    ``send`` and ``receive`` are checkpoints, except that a ``send`` handing its item straight to a parked
    receiver does not yield (see there); a sender parks until the consumer takes its item (a cancelled
    sender's item is never delivered); ``close_send`` ends the consumer's iteration (``EndOfChannel``) and
    ``close_receive`` fails a parked or later ``send`` with ``BrokenResourceError``.
    """

    __slots__ = ("_item", "_receive_closed", "_receiver", "_send_closed", "_sender")

    def __init__(self) -> None:
        self._item: Any = None
        self._sender: Any = None  # the parked sender task
        self._receiver: Any = None  # the parked receiver task
        self._send_closed = False
        self._receive_closed = False

    async def send(self, item: ChunkBatch) -> None:
        await _checkpoint_if_cancelled()
        if self._send_closed:
            raise trio.ClosedResourceError
        if self._receive_closed:
            raise trio.BrokenResourceError
        receiver = self._receiver
        if receiver is not None:
            # Straight to the parked receiver. No schedule point here: the request task's next step either
            # parks (no message yet, or this send's successor finds the receiver not back yet) or is a
            # cancellation point, so it never runs more than one chunk ahead, and one task switch per chunk
            # is saved.
            self._receiver = None
            _reschedule(receiver, _Value(item))
            return
        self._item = item
        self._sender = _current_task()

        def abort(_raise_cancel: Any) -> Any:
            self._sender = None
            self._item = None
            return _ABORT_SUCCEEDED

        await _wait_task_rescheduled(abort)

    async def receive(self) -> ChunkBatch:
        await _checkpoint_if_cancelled()
        if self._receive_closed:
            raise trio.ClosedResourceError
        sender = self._sender
        if sender is not None:
            item = self._item
            self._sender = None
            self._item = None
            _reschedule(sender)
            await _cancel_shielded_checkpoint()
            return item
        if self._send_closed:
            raise trio.EndOfChannel
        self._receiver = _current_task()

        def abort(_raise_cancel: Any) -> Any:
            self._receiver = None
            return _ABORT_SUCCEEDED

        return await _wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def close_send(self) -> None:
        if self._send_closed:
            return
        self._send_closed = True
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            _reschedule(receiver, _Error(trio.EndOfChannel()))

    def close_receive(self) -> None:
        if self._receive_closed:
            return
        self._receive_closed = True
        sender = self._sender
        if sender is not None:
            self._sender = None
            self._item = None
            _reschedule(sender, _Error(trio.BrokenResourceError()))


class _State(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    STARTED = "started"
    CLOSING = "closing"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Request:
    request_id: str
    ctx: GenerateContext
    state: Any  # convert.response.ResponseState
    builder: BatchBuilder  # decides what the request task does with each message (owns ``state``)
    built: Any  # convert.request.BuiltRequest
    decode: bool
    send: _Handoff | None  # generate(): the hand-off to the caller
    sink: ChunkSink | None = None  # submit(): where the chunks go instead
    #: Cancelled by the client's cancellation or by engine shutdown (see the module docstring).
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    opened: trio.Event = attrs.field(factory=trio.Event)  # the open finished (either way)
    done: trio.Event = attrs.field(factory=trio.Event)
    open_error: BaseException | None = None
    final: LLMEngineOutput | None = None
    error: BaseException | None = None
    request_cancelled: bool = False  # decode: client cancellation recorded, waiting for the transfer
    #: The scope was cancelled (it has no deadline, so only ``client_cancel``/``cancel_shutdown`` cancel
    #: it); a plain flag, read once per message (``CancelScope.cancel_called`` reads the clock).
    cancelling: bool = False

    def client_cancel(self) -> None:
        """The client's cancellation signal (docs/reference/sidecar.md#cancellation-signals): immediate, or deferred in decode mode (docs/reference/sidecar.md#decode-deferral)."""
        if self.done.is_set():
            return
        if self.decode and not self.builder.transfer_completed:
            self.request_cancelled = True
        else:
            self.cancelling = True
            self.scope.cancel()

    def cancel_shutdown(self) -> None:
        """Engine shutdown: interrupts every phase in every mode."""
        self.cancelling = True
        self.scope.cancel()


class _ChunkStream:
    """The async iterator yielded by ``generate()``: channel chunks, then the final chunk or error.

    The request task hands chunks over in batches; they are returned one per ``__anext__``. Once the
    request is cancelled, the rest of a batch is dropped and the cancelled chunk's usage no longer counts it.
    """

    def __init__(self, request: _Request, receive: _Handoff) -> None:
        self._request = request
        self._receive = receive
        self._finished = False
        self._batch: ChunkBatch | None = None  # the batch being returned

    def __repr__(self) -> str:
        return f"<generate stream {self._request.request_id!r}{' finished' if self._finished else ''}>"

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> _ChunkStream:
        return self

    def _drop_batch(self, batch: ChunkBatch) -> None:
        self._batch = None
        if not batch:
            return
        request = self._request
        state = request.state
        state.completion_tokens -= batch.drop()
        if request.done.is_set() and request.final is not None:
            request.final = state.cancelled_chunk()  # built before the drop

    async def __anext__(self) -> LLMEngineOutput:
        if self._finished:
            raise StopAsyncIteration
        batch = self._batch
        if batch is not None:
            if self._request.cancelling:
                self._drop_batch(batch)
            else:
                await _checkpoint_if_cancelled()
                chunk = batch.take()
                if chunk is not None:
                    return chunk
                self._batch = None
        try:
            batch = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            pass
        else:
            self._batch = batch
            return batch.take()  # type: ignore[return-value]  # (a batch handed over is never empty)
        self._finished = True
        request = self._request
        if request.final is not None:
            chunk, request.final = request.final, None
            return chunk
        if request.error is not None:
            raise request.error
        raise StopAsyncIteration


class SidecarEngine:
    """Start / generate / cleanup against one vLLM gRPC endpoint (docs/reference/sidecar.md#start-phase, docs/reference/sidecar.md#lifecycle, docs/reference/sidecar.md#cancellation).

    Usually driven by :func:`trio_sidecar.open_sidecar`; the CLI's Dynamo bridge uses the same object.

    Resource handling: :meth:`start` puts the connection tasks, the abort sender and every request task in
    the nursery it is given; :meth:`cleanup` ends all of them except the nursery itself, which the owner
    closes.
    """

    def __init__(self, config: SidecarConfig, *, endpoint: GrpcEndpoint | None = None) -> None:
        self.config = config
        self.endpoint = endpoint if endpoint is not None else validate_sidecar_config(config)
        self.mode = DisaggregationMode.parse(config.disaggregation_mode)
        self.model: DiscoveredModel | None = None
        self.engine_config: EngineConfig | None = None
        self.kv_event_sources: tuple[Any, ...] = ()
        #: Called after conversion and before the RPC opens; raises to reject (the admission gate, docs/reference/sidecar.md#admission).
        self.admission_check: Callable[[], None] | None = None
        self._state = _State.CREATED
        self._closed = trio.Event()  # set once the state reaches CLOSED
        self._admitting = True
        self._nursery: trio.Nursery | None = None
        self._pool: ChannelPool | None = None
        self._requests: set[_Request] = set()
        self._idle = trio.Event()
        self._idle.set()
        self._abort_send: trio.MemorySendChannel[str] | None = None
        self._abort_scope = trio.CancelScope()
        self._abort_done = trio.Event()
        #: Counters, for tests and ``repr``.
        self.aborts_queued = 0
        self.aborts_sent = 0

    def __repr__(self) -> str:
        return (
            f"<SidecarEngine {self.endpoint.canonical} {self.mode.value} [{self._state.value}, "
            f"{len(self._requests)} in flight, {self.aborts_queued} aborts queued]>"
        )

    # ---------------------------------------------------------------- lifecycle

    @property
    def started(self) -> bool:
        return self._state is _State.STARTED

    @property
    def pool(self) -> ChannelPool | None:
        return self._pool

    async def start(self, nursery: trio.Nursery, *, expected: DiscoveredModel | None = None) -> EngineConfig:
        """The start phase (docs/reference/sidecar.md#start-phase).

        Args:
            nursery: the sidecar's nursery; it must outlive the engine (until :meth:`cleanup` returned).
            expected: the bootstrap model; when given, the identity check (docs/reference/sidecar.md#identity-check) runs against it.

        Returns:
            The registration data built from the start-phase discovery (docs/reference/sidecar.md#registration-data).

        Raises:
            EngineShutdown: ``vLLM sidecar has already started`` (also for a concurrent second start).
            CannotConnect, ConnectionTimeout, ProtocolError, SidecarError: docs/reference/sidecar.md#connection-pool, docs/reference/sidecar.md#identity-check, docs/reference/sidecar.md#kv-event-sources. On any failure the
            engine is cleaned up (never left started; docs/reference/sidecar.md#start-phase).
        """
        if self._state is not _State.CREATED:
            raise EngineShutdown(ALREADY_STARTED)
        self._state = _State.STARTING
        self._nursery = nursery
        config = self.config
        LOGGER.info(
            "connecting to vLLM gRPC endpoint=%s connections=%d mode=%s",
            self.endpoint.canonical,
            config.grpc_connections,
            self.mode.value,
        )
        ok = False
        try:
            deadline = trio.current_time() + config.startup_deadline
            self._pool = await ChannelPool.connect(nursery, self.endpoint, config, deadline=deadline)
            await wait_for_services(
                self._pool,
                [CONTROL_SERVICE, INFERENCE_SERVICE],
                deadline=deadline,
                retry_interval=config.retry_interval,
            )
            model = await discover_model(self._pool, deadline=deadline)
            if expected is not None:
                ensure_startup_compatible(expected, model)
            if self._state is not _State.STARTING:  # cleanup() ran meanwhile
                raise EngineShutdown(NOT_STARTED)
            self.model = model
            self.engine_config = engine_config(model)
            self._state = _State.STARTED
            LOGGER.info("vLLM gRPC services are ready")
            self.kv_event_sources = await fetch_kv_event_sources(
                self._pool, self.endpoint, model, deadline=deadline
            )
            if config.abort_on_cancel:
                send, receive = trio.open_memory_channel[str](math.inf)
                self._abort_send = send
                await nursery.start(self._run_abort_sender, receive)
            ok = True
            return self.engine_config
        finally:
            if not ok:
                with trio.CancelScope(shield=True):
                    await self._close()

    async def cleanup(self) -> None:
        """End everything the engine owns (docs/reference/sidecar.md#lifecycle). Idempotent; safe before :meth:`start`.

        Stops admission; every in-flight request ends with a cancelled chunk (a request still waiting for
        headers gets a one-item cancelled stream); queued Aborts are flushed with a 5 s shielded grace;
        connections close.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            with trio.CancelScope(shield=True):
                await self._closed.wait()
            return
        if self._state is _State.CREATED:
            self._state = _State.CLOSED
            self._closed.set()
            return
        await self._close()

    async def _close(self) -> None:
        self._state = _State.CLOSING
        self._admitting = False
        with trio.CancelScope(shield=True):
            self.cancel_in_flight()
            await self._idle.wait()
            if self._abort_send is not None:
                self._abort_send.close()
                with trio.move_on_after(ABORT_FLUSH_GRACE):
                    await self._abort_done.wait()
            self._abort_scope.cancel()
            if self._pool is not None:
                await self._pool.aclose()
        self._state = _State.CLOSED
        self._closed.set()

    # ---------------------------------------------------------------- drain support (CLI)

    @property
    def in_flight(self) -> int:
        """Requests whose request task has not ended yet."""
        return len(self._requests)

    def stop_admission(self) -> None:
        """New ``generate()`` calls fail with ``vLLM sidecar is not started``; in-flight ones continue."""
        self._admitting = False

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    def cancel_in_flight(self) -> None:
        """Cancel every in-flight request as engine shutdown does: cancelled chunk, Abort queued."""
        for request in list(self._requests):
            request.cancel_shutdown()

    # ---------------------------------------------------------------- generate

    @asynccontextmanager
    async def generate(
        self, request: dict[str, Any] | PreprocessedRequest, ctx: GenerateContext | None = None
    ) -> AsyncIterator[_ChunkStream]:
        """Open one generation (docs/reference/sidecar.md#request-conversion, docs/reference/sidecar.md#response-conversion, docs/reference/sidecar.md#cancellation).

        ``__aenter__`` converts the request (``InvalidArgument`` on error; nothing is sent), checks admission,
        opens ``GenerateStream`` and waits for the open: an open failure raises the mapped error (docs/reference/sidecar.md#stream-level-rules).
        The yielded iterator produces :class:`LLMEngineOutput` chunks; a stream error is raised from iteration
        after the chunks already produced.

        Cancellation: ``ctx.stop()`` ends the stream with a cancelled chunk (decode mode defers it until the
        KV transfer completed). Leaving the block early, or cancelling the caller's scope, drops the stream
        and queues an Abort; ``trio.Cancelled`` propagates at once (decode mode keeps reading in the
        background until the transfer completed).
        """
        if ctx is None:
            ctx = GenerateContext()
        handoff = _Handoff()
        req = self._start_request(request, ctx, handoff, None)
        try:
            await req.opened.wait()
            if req.open_error is not None:
                raise req.open_error
            yield _ChunkStream(req, handoff)
        finally:
            ctx._unsubscribe(req.client_cancel)
            req.client_cancel()
            handoff.close_receive()

    def submit(
        self, request: dict[str, Any] | PreprocessedRequest, ctx: GenerateContext, sink: ChunkSink
    ) -> None:
        """Start one generation whose output goes to ``sink`` instead of an iterator (a synchronous call).

        The same request, cancellation (``ctx.stop()``, decode deferral, engine shutdown) and Abort
        behaviour as :meth:`generate`, for a consumer that never makes the engine wait (the Dynamo bridge
        queues every chunk for its asyncio thread): no consumer task and no hand-over. Chunks are
        delivered as soon as their messages are read (``ResponseStream.listen``), those of messages read
        together at once and a run of plain token chunks as one ``tokens`` call, so there is no back-pressure
        beyond the sink's; an open failure reaches ``sink.end`` as the error.

        Raises (nothing was sent, ``sink`` is not called):
            InvalidArgument: conversion failed.
            CannotConnect: admission closed (the ``admission_check``).
            EngineShutdown: ``vLLM sidecar is not started``.
        """
        self._start_request(request, ctx, None, sink)

    def _start_request(
        self,
        request: dict[str, Any] | PreprocessedRequest,
        ctx: GenerateContext,
        handoff: _Handoff | None,
        sink: ChunkSink | None,
    ) -> _Request:
        if self._state is not _State.STARTED or not self._admitting:
            raise EngineShutdown(NOT_STARTED)
        assert self.model is not None and self._nursery is not None
        preprocessed = structure_request(request)
        request_id = ctx.request_id or str(uuid.uuid4())
        built = build_generate_request(preprocessed, request_id, self.model.served_model_name, self.mode)
        if self.admission_check is not None:
            self.admission_check()
        state = ResponseState(preprocessed, built, self.mode)
        decode = self.mode.is_decode
        req = _Request(
            request_id=request_id,
            ctx=ctx,
            state=state,
            builder=BatchBuilder(state, decode=decode),
            built=built,
            decode=decode,
            send=handoff,
            sink=sink,
        )
        ctx._subscribe(req.client_cancel)
        if not self._requests:
            self._idle = trio.Event()  # (only on the empty → busy edge: wait_idle() callers hold the old one)
        self._requests.add(req)
        self._nursery.start_soon(self._run_request, req, name=f"vllm-request {request_id}")
        return req

    async def _run_request(self, req: _Request) -> None:
        sent = False  # the request left for the server
        server_ended = False  # terminal, EOF, a status, or a lost connection: no Abort needed
        try:
            with req.scope:
                if not req.cancelling:
                    assert self._pool is not None
                    channel = await self._pool.channel("GenerateStream")
                    await trio.lowlevel.checkpoint_if_cancelled()  # biased
                    sent = True
                    async with channel.unary_stream(
                        GENERATE_STREAM,
                        req.built.message,
                        None,  # serialized messages: the builder parses only those it has to
                        metadata=req.built.metadata,
                    ) as stream:
                        req.opened.set()
                        if req.sink is None:
                            server_ended = await self._pump(req, stream)
                        else:
                            server_ended = await self._listen(req, stream)
        except SidecarError as exc:
            server_ended = True
            self._fail(req, exc)
        except Exception as exc:
            if not isinstance(exc, RpcError):
                LOGGER.exception("unexpected failure in request %s", req.request_id)
                server_ended = False
                self._fail(req, exc)
            else:
                server_ended = True
                self._fail(req, status_to_error("GenerateStream", exc.code, exc.message))
        finally:
            if req.final is None and req.error is None and req.open_error is None:
                # Cancelled (client or shutdown) before the server ended the stream.
                req.final = req.state.cancelled_chunk()
            if sent and not server_ended:
                self._queue_abort(req.request_id)
            req.opened.set()
            sink = req.sink
            if sink is None:
                req.send.close_send()  # type: ignore[union-attr]
            req.done.set()
            self._requests.discard(req)
            if not self._requests:
                self._idle.set()
            if sink is not None:
                req.ctx._unsubscribe(req.client_cancel)
                final = req.final
                try:
                    sink.end(final, None if final is not None else req.error or req.open_error)
                except Exception:  # a sink must not raise; one that does must not take the engine down
                    LOGGER.exception("the sink of request %s failed at its end", req.request_id)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        if not req.opened.is_set():
            req.open_error = exc
        elif req.request_cancelled and not req.cancelling:
            LOGGER.warning(WARN_ERROR_AFTER_CANCEL)
            req.final = req.state.cancelled_chunk()
        else:
            req.error = exc

    async def _pump(self, req: _Request, stream: Any) -> bool:
        """Read the stream until it ends; returns whether the *server* ended it.

        The decisions are ``req.builder``'s (``convert.batch``); this loop does the awaits. Messages the
        transport already received are fed to the builder without awaiting (``next_buffered``) and the
        chunks of a run of them handed over as one batch; the message that ends the request comes after
        its batch was handed over, as if read on its own.
        """
        builder = req.builder
        add = builder.add
        next_buffered = stream.next_buffered
        async for data in stream:
            if req.cancelling:  # biased: a cancellation that raced with this message wins
                await trio.lowlevel.checkpoint()
            # (No await until the hand-over: ``cancelling`` and ``request_cancelled`` cannot change.)
            step = add(data, req.request_cancelled)
            while step is MORE:
                data = next_buffered()  # (serialized messages: never raises)
                if data is None:
                    break
                step = add(data, req.request_cancelled)
            batch = builder.take_batch()
            if step is END:
                ending = builder.ending
                assert ending is not None
                if batch is not None:
                    await self._hand_over(req, batch, later=ending.tokens)
                return self._end(req, ending)
            if batch is not None:
                await self._hand_over(req, batch)
        return self._end(req, builder.eof(req.request_cancelled))

    async def _listen(self, req: _Request, stream: Any) -> bool:
        """``submit()``'s ``_pump``: each message goes through ``req.builder`` as the connection's reader
        receives it, and the chunks of the messages read together go to the sink at once, at the end of
        their run (``ResponseStream.listen``'s ``flush``; :func:`deliver_items` merges plain token chunks);
        this task only waits for the end. Returns whether the *server* ended the stream.

        Converted and delivered stay equal for the cancellation's usage: a run is converted and delivered
        in one go of the reader (no checkpoint between them), and the terminal message delivers the chunks
        before it at once.
        """
        builder = req.builder
        add = builder.add
        take_items = builder.take_items
        sink = req.sink
        assert sink is not None
        sink_chunk = sink.chunk
        sink_tokens = sink.tokens
        failure: list[BaseException] = []

        def deliver() -> bool:  # never raises
            try:
                items = take_items()
                if items:
                    deliver_items(items, sink_tokens, sink_chunk)
            except Exception as exc:  # a bug: reported by this task, as _pump would raise it
                failure.append(exc)
                return True
            return False

        def on_message(data: bytes) -> bool:  # reader task (or this one): never awaits, never raises
            if req.cancelling:  # the scope is cancelled: this task ends at its next checkpoint
                return True
            try:
                step = add(data, req.request_cancelled)
            except Exception as exc:  # a bug: reported by this task, as _pump would raise it
                failure.append(exc)
                deliver()  # what the run converted before it
                return True
            if step is END:
                deliver()
                return True
            return False

        stopped = await stream.listen(on_message, deliver)
        if failure:
            raise failure[0]
        ending = builder.ending
        if stopped and ending is not None:
            # Applied even if a cancellation came after the listener converted the ending message: its
            # tokens are counted already, so the sink gets that message's chunk (or error) as the last one.
            return self._end(req, ending)
        if req.cancelling:
            await trio.lowlevel.checkpoint()  # raises Cancelled: the scope was cancelled
        return self._end(req, builder.eof(req.request_cancelled))

    def _end(self, req: _Request, ending: Ending) -> bool:
        """Apply the builder's ending; returns whether the server ended the stream."""
        if ending.warning is not None:
            LOGGER.warning(ending.warning)
        if ending.first_token:
            req.ctx._notify_first_token()
        if ending.error is not None:
            req.error = ending.error
        else:
            req.final = ending.final
        return ending.server_ended

    async def _hand_over(self, req: _Request, batch: ChunkBatch, *, later: int | None = None) -> None:
        """Hand ``batch`` over to the caller.

        ``later`` (the tokens it counted) means a later message was already converted: if the hand-over or
        the biased check that follows it is cancelled, the usage is put back to what the caller received,
        as if that message had not been read.
        """
        # Adjustments are relative: the caller may drop an earlier batch's rest meanwhile (``_ChunkStream``).
        state = req.state
        try:
            await req.send.send(batch)
        except trio.Cancelled:
            # Never delivered: the cancelled chunk's usage counts what the caller received (upstream
            # yields each chunk as it converts it, so there "converted" and "delivered" coincide).
            state.completion_tokens -= batch.tokens() + (later or 0)
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            state.completion_tokens -= batch.tokens()
            req.client_cancel()  # the caller left
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except trio.Cancelled:
                state.completion_tokens -= later or 0
                raise
            return
        if later is not None and req.cancelling:  # biased, as before the next message's conversion
            try:
                await trio.lowlevel.checkpoint()
            except trio.Cancelled:
                state.completion_tokens -= later
                raise

    # ---------------------------------------------------------------- abort sender (docs/reference/sidecar.md#abort-after-abandoning-a-stream)

    def _queue_abort(self, request_id: str) -> None:
        if self._abort_send is None:
            return
        try:
            self._abort_send.send_nowait(request_id)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        self.aborts_queued += 1

    async def _run_abort_sender(
        self, receive: trio.MemoryReceiveChannel[str], *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self._abort_scope:
                task_status.started()
                async with receive:
                    async for first in receive:
                        ids = [first]
                        while True:
                            try:
                                ids.append(receive.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        await self._send_abort(ids)
        finally:
            self._abort_done.set()

    async def _send_abort(self, ids: list[str]) -> None:
        timeout = self.config.abort_timeout
        assert self._pool is not None
        try:
            with trio.move_on_after(timeout) as scope:
                await self._pool.unary(
                    "Abort", ABORT, control_pb2.AbortRequest(request_ids=ids), control_pb2.AbortResponse
                )
        except SidecarError as exc:
            LOGGER.warning("Control.Abort failed for %s: %s", ids, exc)
            return
        if scope.cancelled_caught:
            LOGGER.warning("Abort did not respond within %ss", f"{timeout:g}")
            return
        self.aborts_sent += len(ids)
