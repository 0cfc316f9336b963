"""The sidecar engine: lifecycle and admission (docs/reference/sidecar.md#start-phase,
docs/reference/sidecar.md#lifecycle, docs/reference/sidecar.md#admission).

Theory of operation
-------------------
:class:`SidecarEngine` owns everything one vLLM endpoint needs: the connection pool, the abort sender
(``abort.AbortSender``) and one request task per in-flight request (``request_task.RequestTask``), all in the
nursery :meth:`SidecarEngine.start` is given. It is the one owner of admission and drain:

* admission: a request is admitted while the engine is started, :meth:`stop_admission` was not called, and
  :attr:`health` (the prober's state) is ``SERVING``;
* drain: :attr:`in_flight`, :meth:`wait_idle`, :meth:`stop_in_flight` (as each client's ``ctx.stop()``),
  :meth:`cancel_in_flight` (as :meth:`cleanup`), and :meth:`drain`, which stops admission, waits, then stops
  the rest: the worker's graceful shutdown calls it.

Each request has one delivery path (``request_task``): its chunks go to a sink as their messages are read.
:meth:`submit` is that path for a ``ChunkSink``; :meth:`generate` is an adapter over it
(``stream.ChunkStream``, an async iterator with back-pressure).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
import trio_util

from ..core.config import DisaggregationMode, SidecarConfig, validate_sidecar_config
from ..core.convert.batch import BatchBuilder
from ..core.convert.request import build_generate_request
from ..core.convert.response import ResponseState
from ..core.endpoint import GrpcEndpoint
from ..core.errors import CannotConnect, EngineShutdown, InvalidArgument, SidecarError
from ..core.health_policy import SERVING_STATE, HealthState
from ..core.model import DiscoveredModel, EngineConfig, engine_config, ensure_startup_compatible
from ..core.protocol import PreprocessedRequest, structure_request
from ..core.routing import KvEventSource
from ..core.stats import SidecarStats, StatsSnapshot
from .abort import ABORT, ABORT_FLUSH_GRACE, AbortSender
from .context import ChunkSink, GenerateContext
from .discovery import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    discover_model,
    fetch_kv_event_sources,
    wait_for_services,
)
from .pool import ChannelPool
from .request_task import GENERATE_STREAM, MergingSink, RequestTask, RunSink
from .stream import ChunkStream

if TYPE_CHECKING:  # (imported only when tracing is on: docs/reference/sidecar.md#opentelemetry-span)
    from .otel import RequestTracing

__all__ = [
    "ABORT",
    "ABORT_FLUSH_GRACE",
    "EXIT_WAIT",
    "GENERATE_STREAM",
    "ChunkSink",
    "ChunkStream",
    "GenerateContext",
    "SidecarEngine",
]

LOGGER = logging.getLogger("trio_sidecar.engine")

NOT_STARTED = "vLLM sidecar is not started"
#: The longest a ``generate()`` block's exit waits for its request task to end (a reset is one frame on a
#: live connection; a wedged one is the pool's to detect).
EXIT_WAIT = 1.0
ALREADY_STARTED = "vLLM sidecar has already started"


def _load_tracing() -> RequestTracing:
    """The engine's span factory (``SidecarConfig.otel``, checked importable by ``validate_sidecar_config``):
    the one place OpenTelemetry gets imported."""
    from .otel import RequestTracing

    return RequestTracing()


class _State(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    STARTED = "started"
    CLOSING = "closing"
    CLOSED = "closed"


class SidecarEngine:
    """Start / generate / cleanup against one vLLM gRPC endpoint, and the admission and drain of its requests.

    Usually driven by :func:`trio_sidecar.open_sidecar`; the CLI's Dynamo bridge uses the same object.

    Attributes:
        health: the prober's state (``open_sidecar`` hands it to the prober); admission is open only while
            it is ``SERVING`` (docs/reference/sidecar.md#admission).
        stats: the recorder of the engine's counters (docs/observability.md), shared with its request tasks,
            its abort sender and the prober; :meth:`snapshot_stats` reads it.

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
        self.kv_event_sources: tuple[KvEventSource, ...] = ()
        self.health: trio_util.AsyncValue[HealthState] = trio_util.AsyncValue(SERVING_STATE)
        self.stats = SidecarStats()
        self._state = _State.CREATED
        self._closed = trio.Event()  # set once the state reaches CLOSED
        self._admitting = True
        self._nursery: trio.Nursery | None = None
        self._pool: ChannelPool | None = None
        self._aborts: AbortSender | None = None
        self._requests: set[RequestTask] = set()
        self._idle = trio.Event()
        self._idle.set()
        #: The sidecar's spans (docs/reference/sidecar.md#opentelemetry-span); ``None`` (the default): off,
        #: and OpenTelemetry is not imported.
        self._tracing: RequestTracing | None = _load_tracing() if config.otel else None

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

    @property
    def aborts_queued(self) -> int:
        """Request ids queued for ``Control.Abort`` (for tests and ``repr``)."""
        return self._aborts.queued if self._aborts is not None else 0

    @property
    def aborts_sent(self) -> int:
        """Request ids whose ``Control.Abort`` call succeeded."""
        return self._aborts.sent if self._aborts is not None else 0

    def snapshot_stats(self) -> StatsSnapshot:
        """The engine's counters, gauges and histograms now (docs/observability.md); safe to call from
        another thread holding the GIL (each field is read at once, see ``stats``)."""
        pool = self._pool
        if pool is None:
            return self.stats.snapshot(health_state=self.health.value.kind.value)
        return self.stats.snapshot(
            health_state=self.health.value.kind.value,
            pool_connections=len(pool),
            pool_connections_up=pool.connections_up,
            pool_reconnects=pool.reconnects,
            pool_reconnect_failures=pool.reconnect_failures,
        )

    async def start(self, nursery: trio.Nursery, *, expected: DiscoveredModel | None = None) -> EngineConfig:
        """The start phase (docs/reference/sidecar.md#start-phase).

        Args:
            nursery: the sidecar's nursery; it must outlive the engine (until :meth:`cleanup` returned).
            expected: the bootstrap model; when given, the identity check
                (docs/reference/sidecar.md#identity-check) runs against it.

        Returns:
            The registration data built from the start-phase discovery (docs/reference/sidecar.md#registration-data).

        Raises:
            EngineShutdown: ``vLLM sidecar has already started`` (also for a concurrent second start).
            CannotConnect, ConnectionTimeout, ProtocolError, SidecarError: docs/reference/sidecar.md#connection-pool,
                docs/reference/sidecar.md#identity-check, docs/reference/sidecar.md#kv-event-sources. On any
                failure the engine is cleaned up (never left started).
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
            self.stats.add_dp_ranks(model.data_parallel_size())
            self._state = _State.STARTED
            LOGGER.info("vLLM gRPC services are ready")
            self.kv_event_sources = await fetch_kv_event_sources(self._pool, self.endpoint, model, deadline=deadline)
            if config.abort_on_cancel:
                self._aborts = AbortSender(self._pool, config.abort_timeout, stats=self.stats)
                await nursery.start(self._aborts.run)
            ok = True
            return self.engine_config
        finally:
            if not ok:
                with trio.CancelScope(shield=True):
                    await self._close()

    async def cleanup(self) -> None:
        """End everything the engine owns (docs/reference/sidecar.md#lifecycle). Idempotent; safe before
        :meth:`start`.

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
            if self._aborts is not None:
                await self._aborts.aclose()
            if self._pool is not None:
                await self._pool.aclose()
        self._state = _State.CLOSED
        self._closed.set()

    # ---------------------------------------------------------------- admission and drain

    @property
    def admitting(self) -> bool:
        """New requests are admitted (started, and :meth:`stop_admission` not called; health aside)."""
        return self._admitting and self._state is _State.STARTED

    @property
    def in_flight(self) -> int:
        """Requests whose request task has not ended yet."""
        return len(self._requests)

    def stop_admission(self) -> None:
        """New ``generate()``/``submit()`` calls fail with ``vLLM sidecar is not started``; in-flight ones
        continue."""
        self._admitting = False

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    def cancel_in_flight(self) -> int:
        """Cancel every in-flight request as engine shutdown does (cancelled chunk, Abort queued; no decode
        deferral); returns how many."""
        requests = list(self._requests)
        for request in requests:
            request.cancel_shutdown()
        return len(requests)

    def stop_in_flight(self) -> int:
        """Stop every in-flight request as its client's ``ctx.stop()`` does (cancelled chunk, Abort queued;
        decode mode defers the stop until the KV transfer completed); returns how many."""
        requests = list(self._requests)
        for request in requests:
            request.ctx.stop()
        return len(requests)

    async def drain(self, timeout: float, *, grace: float) -> int:
        """Graceful drain, the one the worker's shutdown uses (docs/reference/worker.md#graceful-shutdown-and-drain).

        Stops admission, waits up to ``timeout`` seconds for the in-flight requests to end, then stops the rest
        as each client's ``ctx.stop()`` would (:meth:`stop_in_flight`: a cancelled chunk and an Abort each; a
        decode request defers its stop until its KV transfer completed, so the prefill worker's blocks are
        released) and waits up to ``grace`` seconds more. Returns how many were stopped (0: all ended within
        ``timeout``). A request still running after that is cancelled by :meth:`cleanup`.
        """
        self.stop_admission()
        with trio.move_on_after(timeout):
            await self._idle.wait()
        stopped = self.stop_in_flight()
        if stopped:
            LOGGER.warning("drain timeout reached; cancelling %d remaining request(s)", stopped)
            with trio.move_on_after(grace):
                await self._idle.wait()
        return stopped

    def _check_admission(self) -> None:
        """After conversion, before the RPC opens (docs/reference/sidecar.md#admission)."""
        state = self.health.value
        if not state.admits:
            reason = state.reason or state.kind.name.lower().replace("_", " ")
            raise CannotConnect(f"vLLM is not serving: {reason}")

    # ---------------------------------------------------------------- requests

    def submit(
        self,
        request: dict[str, Any] | PreprocessedRequest,
        ctx: GenerateContext,
        sink: ChunkSink,
        *,
        merge: bool = True,
    ) -> None:
        """Start one generation whose output goes to ``sink`` (a synchronous call; the engine's one
        delivery path, docs/reference/sidecar.md#embedded-api).

        Chunks are delivered as soon as their messages are read (``ResponseStream.listen``), those of
        messages read together at once and a run of plain token chunks as one ``tokens`` call, so there is
        no back-pressure beyond the sink's; an open failure reaches ``sink.end`` as the error. Cancellation:
        ``ctx.stop()`` (decode mode defers it, docs/reference/sidecar.md#decode-deferral) and engine shutdown
        end the request with a cancelled chunk; an opened stream abandoned before the server ended it is
        aborted. ``merge=False`` delivers one chunk per vLLM message instead, as the native sidecar does:
        Dynamo's reasoning parser counts ``reasoning_tokens`` chunk by chunk (docs/reference/worker.md#parsers).

        Raises (nothing was sent, ``sink`` is not called):
            InvalidArgument: conversion failed.
            CannotConnect: ``vLLM is not serving: {reason}`` (admission closed by the prober's state).
            EngineShutdown: ``vLLM sidecar is not started`` (not started, stopped admitting, or closed).
        """
        self._start_request(request, ctx, MergingSink(sink, merge=merge))

    @asynccontextmanager
    async def generate(
        self,
        request: dict[str, Any] | PreprocessedRequest,
        ctx: GenerateContext | None = None,
        *,
        text: str | None = None,
    ) -> AsyncIterator[ChunkStream]:
        """Open one generation: :meth:`submit` with an async iterator as its sink (``stream.ChunkStream``).

        ``__aenter__`` converts the request (``InvalidArgument`` on error; nothing is sent), checks admission,
        starts the request and waits for the open: an open failure raises the mapped error
        (docs/reference/sidecar.md#stream-level-rules). The yielded iterator produces
        :class:`~trio_sidecar.core.protocol.LLMEngineOutput` chunks, one per message; a stream error is raised
        from iteration after the chunks already produced. The request reads at most one run of messages
        ahead of the caller (back-pressure reaches HTTP/2 flow control).

        ``text``: a text prompt for vLLM to tokenize (see ``build_generate_request``); ``request.token_ids``
        may then be empty.

        Cancellation: ``ctx.stop()`` ends the stream with a cancelled chunk (decode mode defers it until the
        KV transfer completed); chunks not taken yet are dropped and not counted. Leaving the block early,
        or cancelling the caller's scope, drops the stream and queues an Abort.

        The exit guarantee (docs/embedded.md#what-a-blocks-exit-guarantees): however the block is left
        (end of stream, ``break``, an exception, a deadline), its exit waits, shielded and for at most
        :data:`EXIT_WAIT` seconds, until the request task ended: the stream is reset (or ended by the
        server) and the request no longer counts in :attr:`in_flight`. Only the queued ``Control.Abort`` is
        sent afterwards, by the abort sender. Decode mode does not wait for a request whose client
        cancellation is deferred (docs/reference/sidecar.md#decode-deferral): it keeps reading in the
        background until the KV transfer completed; :meth:`wait_idle` waits for it.
        """
        if ctx is None:
            ctx = GenerateContext()
        stream = ChunkStream()
        req = self._start_request(request, ctx, stream, text=text)
        stream.bind(req.request_id, req.state)
        try:
            await req.opened.wait()
            if req.open_error is not None:
                raise req.open_error
            yield stream
        finally:
            req.client_cancel()  # (no-op once the request ended; it unsubscribes from ``ctx`` then)
            stream.close()
            if not req.ended.is_set() and not req.request_cancelled:  # (deferred in decode mode: not waited)
                with trio.CancelScope(deadline=trio.current_time() + EXIT_WAIT, shield=True):
                    await req.ended.wait()

    def _start_request(
        self,
        request: dict[str, Any] | PreprocessedRequest,
        ctx: GenerateContext,
        sink: RunSink,
        *,
        text: str | None = None,
    ) -> RequestTask:
        stats = self.stats
        if not self._admitting or self._state is not _State.STARTED:
            stats.request_rejected("not_started")
            raise EngineShutdown(NOT_STARTED)
        assert self.model is not None and self._nursery is not None
        started_at = time.perf_counter()
        try:
            preprocessed = structure_request(request)
            request_id = ctx.request_id or str(uuid.uuid4())
            built = build_generate_request(
                preprocessed,
                request_id,
                self.model.served_model_name,
                self.mode,
                lora_supported=self.model.supports_lora,
                text=text,
            )
        except InvalidArgument:
            stats.request_rejected("invalid_argument")
            raise
        try:
            self._check_admission()
        except CannotConnect:
            stats.request_rejected("not_serving")
            raise
        state = ResponseState(preprocessed, built, self.mode)
        decode = self.mode.is_decode
        req = RequestTask(
            request_id=request_id,
            ctx=ctx,
            state=state,
            builder=BatchBuilder(state, decode=decode),
            built=built,
            decode=decode,
            sink=sink,
            stats=stats,
            started_at=started_at,
        )
        ctx._subscribe(req.client_cancel)
        if not self._requests:
            self._idle = trio.Event()  # (only on the empty → busy edge: wait_idle() callers hold the old one)
        self._requests.add(req)
        stats.request_started(built.dp_rank)
        self._nursery.start_soon(self._run_request, req, name=f"vllm-request {request_id}")
        return req

    async def _run_request(self, req: RequestTask) -> None:
        try:
            assert self._pool is not None
            aborts = self._aborts
            await req.run(self._pool, aborts.queue if aborts is not None else None, self._tracing)
        finally:
            self._requests.discard(req)
            if not self._requests:
                self._idle.set()
            self._count_end(req)
            req.end()
            req.ended.set()

    def _count_end(self, req: RequestTask) -> None:
        """Count the request's outcome, tokens and inter-token latency (docs/observability.md)."""
        state = req.state
        later_tokens = state.completion_tokens - req.first_tokens
        if req.first_tokens and later_tokens > 0:
            # the mean interval between the tokens after the first delivery, up to the request's end
            self.stats.itl.observe((time.perf_counter() - req.first_token_at) / later_tokens)
        final = req.final
        prompt_tokens = state.prompt_tokens if req.streamed else 0
        completion_tokens = state.reported_completion_tokens()
        if final is not None:
            self.stats.request_finished(
                req.built.dp_rank, final.finish_reason or "none", None, prompt_tokens, completion_tokens
            )
            return
        error = req.error or req.open_error
        kind = error.kind.value if isinstance(error, SidecarError) else None
        self.stats.request_finished(req.built.dp_rank, None, kind, prompt_tokens, completion_tokens)
