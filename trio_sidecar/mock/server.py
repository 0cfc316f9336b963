"""The mock vLLM gRPC server: Inference, Control and Health on one port (docs/reference/mock.md#startup-and-shutdown, docs/reference/mock.md#in-process-api-and-test-hooks).

Theory of operation
-------------------
``open_mock_server`` owns one nursery for the server's lifetime. In it run one simulated engine
(:class:`~trio_sidecar.mock.scheduler.RankEngine`) per DP rank and the gRPC server (``serve_grpc``) with
three servicers. Leaving the context cancels all of it and closes the ZMQ sockets.

A generation call goes through the rows (docs/reference/mock.md#request-validation) in order: the DP-rank metadata (rows 1–2), a non-blocking
concurrency permit (row 3), the pure checks and output planning of :mod:`.validation` (rows 4–18), the
in-flight id check (row 19); then the request is submitted to its rank's scheduler (row 20 may reject
it). From then on it is a :class:`_Call` registered under its request UUID in the server's routes until
the RPC ends, however it ends; the permit is held for exactly as long.

The scheduler delivers output signals into the call's own channel (never full: unread tokens are coalesced
into two counters, see :mod:`.scheduler`), so a slow reader never stalls a pass, is never shed, and costs
no memory per token it has not read (docs/reliability.md). ``Control.Abort`` and shutdown
wake a waiting handler by cancelling the scheduler request, which closes that buffer; signals already in
it are still received. Exactly one terminal is sent per request: a claim flag on the call decides between
the natural finish and an abort that race. Abort flushes the already-buffered tokens first, then sends an
``ABORTED`` terminal with no tokens (docs/reference/mock.md#cancellation-and-abort) and the RPC ends OK, like vLLM.

A dropped stream (RST_STREAM, disconnect, deadline) cancels the handler; its ``finally`` cancels the
scheduler request at once, which frees its KV blocks and its running/waiting slot.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, NoReturn

import attrs
import trio
import trio_util

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock import engine_args as _engine_args
from trio_sidecar.mock import lora as _lora
from trio_sidecar.mock import rl as _rl
from trio_sidecar.mock.config import MockConfig, MockConfigError, PreparedConfig, parse_listen, prepare_config
from trio_sidecar.mock.control import ControlServicer, model_info, rl_capabilities, server_info
from trio_sidecar.mock.generation import (
    ByteDetokenizer,
    RequestRejected,
    request_uuid,
)
from trio_sidecar.mock.handoff import Role, encode_terminal_params, prefill_terminal_params
from trio_sidecar.mock.inference import InferenceServicer
from trio_sidecar.mock.metrics import MockMetrics
from trio_sidecar.mock.tiny_model import WordText
from trio_sidecar.mock.validation import PreparedRequest, parse_dp_rank, prepare_request
from trio_sidecar.transport import (
    DEFAULT_MAX_MESSAGE_LENGTH,
    HealthServicer,
    RpcError,
    collapse_single_exception,
    serve_grpc,
)

__all__ = [
    "CALL_HISTORY",
    "HEALTH_SERVICES",
    "CallRecord",
    "MockConfig",
    "MockConfigError",
    "MockServer",
    "open_mock_server",
    "parse_listen",
    "serve_mock",
]

LOGGER = logging.getLogger("trio_sidecar.mock")

HEALTH_SERVICES = ("", "vllm.Control", "vllm.Inference")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FinishReason = pb.FinishInfo.FinishReason

SHUTTING_DOWN = "server shutting down"
# Most buffered signals taken per wake-up: bounds the work between two checkpoints, and one run of
# plain token messages (~40 bytes each) stays within one 16 KiB HTTP/2 frame.
_BATCH_LIMIT = 256
# How long graceful shutdown waits for failed in-flight calls to leave before the server is torn down.
DRAIN_GRACE_S = 2.0


def _rejected(err: RequestRejected) -> RpcError:
    return RpcError(err.code, err.message)


class _Claim(enum.Enum):
    FINISH = "finish"
    ABORT = "abort"
    DROP = "drop"


class _Call:
    """One admitted generation request, from validation until its RPC ends (see module docstring)."""

    def __init__(self, server: MockServer, prepared: PreparedRequest, rank: int) -> None:
        self.server = server
        self.prepared = prepared
        self.rank = rank
        local = rank - server._first_rank  # the index of a hosted (global) rank
        self.engine = server._engines[local]
        self.timer = server.request_metrics.timer(local, len(prepared.prompt))  # vLLM-named metrics
        self.sent = 0  # tokens handed to the client so far
        self.claim: _Claim | None = None
        self.shutting_down = False
        self._receive: Any = None  # the scheduler's TokenReceiver once submitted

    # --- decisions (synchronous) ---------------------------------------------------------------------

    def record(self) -> CallRecord:
        return CallRecord(self.prepared.request_id, self.sent, None if self.claim is None else self.claim.value)

    def try_claim(self, claim: _Claim) -> bool:
        if self.claim is not None:
            return False
        self.claim = claim
        return True

    def abort(self) -> None:
        """``Control.Abort``: claim the terminal (unless the request already finished) and stop the engine."""
        if not self.try_claim(_Claim.ABORT):
            return
        try:
            self.engine.cancel(self.prepared.uuid)  # applied at once; closes the output channel
        except Exception as exc:  # an engine bug; Abort reports it (docs/reference/mock.md#cancellation-and-abort)
            LOGGER.exception("abort of request %s failed", self.prepared.request_id)
            raise RpcError(StatusCode.INTERNAL, f"Mocker abort failed: {exc}") from None

    def shutdown(self) -> None:
        """Graceful shutdown: the call fails with UNAVAILABLE at its next step; its engine work stops now."""
        self.shutting_down = True
        self.engine.cancel(self.prepared.uuid)

    def release(self) -> None:
        """The RPC ended (any way): stop the engine work if it is still live, unregister, free the permit."""
        if self.try_claim(_Claim.DROP) and self.engine.cancel(self.prepared.uuid):
            LOGGER.debug("auto-aborting request due to dropped stream request_id=%r", self.prepared.request_id)
        self.timer.ended()
        if self._receive is not None:
            self._receive.close()
        self.server._unregister(self)

    # --- the output pump -------------------------------------------------------------------------------

    def submit(self) -> None:
        """Hand the request to the scheduler (row 20 of docs/reference/mock.md#request-validation may raise ``CapacityError``)."""
        from trio_sidecar.mock.scheduler import SimRequest

        p = self.prepared
        self._receive = self.engine.submit(
            SimRequest(
                uuid=p.uuid,
                prompt=p.prompt,
                plan=p.plan.tokens,
                cache_salt=p.cache_salt,
                bypass_prefix_cache=p.bypass_prefix_cache,
                priority=p.priority,
                mm_spans=p.mm_spans,
            )
        )

    async def next_output(self) -> tuple[list[int], pb.FinishInfo | None]:
        """Wait for the next tokens: ``(tokens, terminal)`` (:meth:`_next_output`). An encode server's one
        token is not an output: it answers a ``STOP`` terminal with no tokens and the encoder handoff in
        ``ec_transfer_params`` (an ``ABORTED`` one counts no tokens either)."""
        tokens, terminal = await self._next_output()
        if self.server._prepared.mode is not Role.ENCODE:
            return tokens, terminal
        if terminal is None:
            return [], None
        p = self.prepared
        if terminal.finish_reason == FinishReason.ABORTED:
            return [], pb.FinishInfo(num_output_tokens=0, finish_reason=FinishReason.ABORTED)
        info = pb.FinishInfo(num_output_tokens=0, finish_reason=FinishReason.STOP)
        info.ec_transfer_params.CopyFrom(encode_terminal_params(p.request_id, [s.identifier for s in p.mm_spans]))
        return [], info

    async def _next_output(self) -> tuple[list[int], pb.FinishInfo | None]:
        """Wait for the next tokens: ``(tokens, terminal)``; ``terminal`` is set once, on the last call.

        Every signal already buffered is taken at once (one wake-up for a reader that lagged behind). A
        ``LENGTH``/``STOP`` terminal belongs with the last token; an ``ABORTED`` terminal carries no token
        and follows the flushed ones.

        Abort and shutdown wake a waiting call by cancelling the scheduler request, which closes its
        output channel (buffered signals are still received first).
        """
        receive = self._receive
        assert receive is not None
        tokens: list[int] = []
        if self.claim is not _Claim.ABORT and not self.shutting_down:
            try:
                signal = receive.receive_nowait()
            except trio.WouldBlock:
                try:
                    signal = await receive.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    signal = None
            except (trio.EndOfChannel, trio.ClosedResourceError):
                signal = None
            while signal is not None:
                if signal.token is None:
                    raise RpcError(StatusCode.INTERNAL, "Mocker output signal is missing a token ID")
                tokens.append(signal.token)
                self.sent += 1
                if signal.completed and self.try_claim(_Claim.FINISH):
                    return tokens, self._finish_info()
                if self.claim is _Claim.ABORT or len(tokens) >= _BATCH_LIMIT:
                    break
                try:
                    signal = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
            if not tokens and self.claim is None and not self.shutting_down:
                raise RpcError(StatusCode.INTERNAL, "Mocker output channel closed before a terminal response")
        if self.shutting_down:
            raise RpcError(StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        if self.claim is _Claim.ABORT:
            tokens += self._flush()
            return tokens, pb.FinishInfo(num_output_tokens=self.sent, finish_reason=FinishReason.ABORTED)
        return tokens, None

    def _flush(self) -> list[int]:
        assert self._receive is not None
        flushed: list[int] = []
        while True:
            try:
                signal = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if signal.token is not None:
                flushed.append(signal.token)
        self.sent += len(flushed)
        return flushed

    def _finish_info(self) -> pb.FinishInfo:
        p = self.prepared
        info = pb.FinishInfo(num_output_tokens=self.sent, finish_reason=p.plan.finish_reason)
        if p.plan.stop_token_id is not None:
            info.stop_token_id = p.plan.stop_token_id
        elif p.plan.eos_token_id is not None:
            info.eos_token_id = p.plan.eos_token_id
        if self.server._prepared.mode is Role.PREFILL:
            info.kv_transfer_params.CopyFrom(prefill_terminal_params(p.uuid, p.request_id, len(p.prompt)))
        return info


@attrs.frozen
class CallRecord:
    """What the mock did for one generation request (:meth:`MockServer.call_record`).

    Attributes:
        request_id: the client's ``request_id``.
        tokens_sent: tokens handed to the client's stream so far.
        ended: ``None`` while the request is in flight and its end undecided; else ``"finish"`` (the terminal
            was sent), ``"abort"`` (``Control.Abort`` came first) or ``"drop"`` (the client dropped the stream
            first).
    """

    request_id: str
    tokens_sent: int
    ended: str | None


#: Ended calls kept for :meth:`MockServer.call_record`.
CALL_HISTORY = 1024


class MockServer:
    """A running mock server and its test hooks (docs/reference/mock.md#in-process-api-and-test-hooks). Built by :func:`open_mock_server`."""

    def __init__(self, prepared: PreparedConfig, engines: Sequence[Any], publishers: Sequence[Any]) -> None:
        self._prepared = prepared
        self._engines = list(engines)
        self._first_rank = prepared.args.data_parallel_rank  # the global DP rank of self._engines[0]
        self._publishers = list(publishers)
        self._routes: dict[str, _Call] = {}
        self._ended_calls: dict[str, CallRecord] = {}  # request id -> its last ended call (insertion order)
        self._permits = trio.Semaphore(prepared.config.max_concurrent_requests)
        self._active = trio_util.AsyncValue(0)
        self._shutting_down = False
        self._record = prepared.config.record_requests
        #: The text of a request's tokens, when not the ``<token:{id}>`` tags: a detokenizer per request.
        self._text_of: Callable[[], Any] | None = _TEXT_MODES.get(prepared.args.text_mode)
        self.health = HealthServicer({name: SERVING for name in HEALTH_SERVICES})
        self.host = prepared.host
        self.port = 0
        self.recorded_requests: list[tuple[str, pb.GenerateRequest, tuple[tuple[str, str], ...], Any]] = []
        self.abort_calls: list[list[str]] = []
        #: Every Control call as ``(rpc name, request)``, in arrival order (a test hook, like
        #: ``recorded_requests``; kept only with ``record_requests``).
        self.control_calls: list[tuple[str, Any]] = []
        #: request id -> the W3C ``traceparent``/``tracestate`` metadata its generation call carried, for the
        #: calls that carried either (a test hook, like ``recorded_requests``; kept only with
        #: ``record_requests``; the last call of an id wins).
        self.trace_headers: dict[str, dict[str, str]] = {}
        #: The adapter table (``lora.enabled`` is false without ``max_loras``) and the RL state.
        self.lora = prepared.policy.lora if prepared.policy.lora is not None else _lora.LoraTable(0, ())
        self.rl = _rl.RlState(rl_capabilities(prepared.args))
        self.server_info = server_info(prepared)
        self.model_info = model_info(prepared)
        #: vLLM-named request and scheduler metrics (``trio_sidecar.mock.metrics``; ``--metrics-port``).
        self.request_metrics = MockMetrics(
            prepared.policy.served_model_name, [partial(self.metrics, rank) for rank in range(len(self._engines))]
        )

    def __repr__(self) -> str:
        ranks = ", ".join(
            f"rank {r}: {m.running_requests} running, {m.waiting_requests} waiting"
            for r, m in ((r, self.metrics(r)) for r in range(len(self._engines)))
        )
        return f"<MockServer {self.address} [{self.active_request_count()} active | {ranks}]>"

    # --- hooks ---------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``IP:PORT`` with the actual port (IPv6 bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def dp_size(self) -> int:
        return len(self._engines)

    @property
    def kv_event_endpoints(self) -> list[str]:
        """Per-rank actually-bound PUB endpoints (``tcp://IP:PORT``); empty when not publishing."""
        return [pub.endpoint for pub in self._publishers]

    def active_request_count(self) -> int:
        """Registered response routes (in-flight generation requests)."""
        return len(self._routes)

    def call_record(self, request_id: str) -> CallRecord | None:
        """The request's call: in flight, else the last one that ended with this id (the last
        :data:`CALL_HISTORY` ended calls are kept), else ``None``. Tells, e.g., "the client dropped the stream
        after the first token" from "before it" (``tokens_sent``, ``ended``)."""
        call = self._routes.get(request_uuid(self._prepared.config.seed, request_id))
        if call is not None:
            return call.record()
        return self._ended_calls.get(request_id)

    def metrics(self, rank: int = 0) -> Any:
        """The rank's metrics snapshot after its last scheduler pass."""
        return self._engines[rank].metrics_value.value

    def metrics_value(self, rank: int = 0) -> trio_util.AsyncValue:
        """The rank's metrics as an ``AsyncValue`` (``await mv.wait_value(pred)``)."""
        return self._engines[rank].metrics_value

    def set_serving_status(self, name: str | None, status: int) -> None:
        """Change a health status; ``name=None`` changes all three. ``Watch`` streams see the change."""
        for service in HEALTH_SERVICES if name is None else (name,):
            self.health.set_status(service, int(status))

    async def graceful_shutdown(self) -> None:
        """The shutdown of docs/reference/mock.md#startup-and-shutdown (step 6) without exiting: NOT_SERVING everywhere, Watch streams end OK, in-flight generation
        fails with ``UNAVAILABLE "server shutting down"``, and new calls are refused the same way.

        Returns once the failed calls have left (bounded by ``DRAIN_GRACE_S``).
        """
        self._shutting_down = True
        self.health.shutdown()
        for call in list(self._routes.values()):
            call.shutdown()
        with trio.move_on_after(DRAIN_GRACE_S):
            await self._active.wait_value(0)

    # --- request plumbing ---------------------------------------------------------------------------

    def begin(self, rpc: str, request: pb.GenerateRequest, context: Any) -> _Call:
        """Rows 1–19 of docs/reference/mock.md#request-validation, then register the call. Raises RpcError."""
        metadata = tuple(getattr(context, "metadata", ()))
        if self._record:
            self.recorded_requests.append((rpc, request, metadata, getattr(context, "peer", None)))
            trace = {key: value for key, value in metadata if key in _TRACE_KEYS}
            if trace:
                self.trace_headers[request.request_id] = trace
        if self._shutting_down:
            raise RpcError(StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        try:
            rank = parse_dp_rank(metadata, len(self._engines), self._first_rank)
        except RequestRejected as err:
            raise _rejected(err) from None
        try:
            self._permits.acquire_nowait()
        except trio.WouldBlock:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "Mocker concurrent request limit reached") from None
        try:
            prepared = prepare_request(request, self._prepared.policy)
            if prepared.uuid in self._routes:
                raise RequestRejected(
                    StatusCode.ALREADY_EXISTS, f"request_id '{prepared.request_id}' is already in flight"
                )
        except RequestRejected as err:
            self._permits.release()
            raise _rejected(err) from None
        except BaseException:
            self._permits.release()
            raise
        if rank is None:
            rank = self._first_rank + min(range(len(self._engines)), key=lambda r: (self._engines[r].load, r))
        call = _Call(self, prepared, rank)
        self._routes[prepared.uuid] = call
        self._active.value = len(self._routes)
        if request.lora_name:
            self.lora.use(request.lora_name)
        return call

    def detokenizer(self, call: _Call) -> Any:
        """The text source of a call's messages (``step(tokens)``/``finish()``): its script's, the text mode's,
        or None (the tags)."""
        if call.prepared.scripted is not None:
            return call.prepared.scripted.detokenizer()
        return None if self._text_of is None else self._text_of()

    def _unregister(self, call: _Call) -> None:
        if self._routes.get(call.prepared.uuid) is call:
            ended = self._ended_calls
            ended.pop(call.prepared.request_id, None)
            ended[call.prepared.request_id] = call.record()
            if len(ended) > CALL_HISTORY:
                del ended[next(iter(ended))]
            del self._routes[call.prepared.uuid]
            self._permits.release()
            self._active.value = len(self._routes)

    def submit(self, call: _Call) -> RpcError | None:
        """Submit to the scheduler. A capacity rejection (row 20) is returned, not raised: a stream
        reports it after ``prompt_info``. Other scheduler rejections are raised as their status."""
        from trio_sidecar.mock.scheduler import CapacityError, SchedulerError

        try:
            call.submit()
        except CapacityError as exc:
            return RpcError(StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except SchedulerError as exc:
            raise RpcError(exc.code, str(exc)) from None
        return None

    def abort(self, request_ids: Sequence[str]) -> None:
        if self._record:
            self.abort_calls.append(list(request_ids))
        seed = self._prepared.config.seed
        for request_id in request_ids:
            call = self._routes.get(request_uuid(seed, request_id))
            if call is not None:
                call.abort()

    async def apply_pause(self, mode: _rl.PauseMode) -> None:
        """What a pause (``PauseGeneration`` or ``Sleep``) does to in-flight requests, as vLLM's engine core:
        abort ends them with an ``ABORTED`` terminal, wait returns once those in flight now have ended, keep
        leaves them. The mock does not hold back new or kept requests while paused
        (docs/reference/mock.md#rl-controls)."""
        if mode is _rl.PauseMode.ABORT:
            for call in list(self._routes.values()):
                call.abort()
        elif mode is _rl.PauseMode.WAIT:
            pending = list(self._routes.values())
            await self._active.wait_value(lambda _: not any(self._routes.get(c.prepared.uuid) is c for c in pending))


_TRACE_KEYS = frozenset(("traceparent", "tracestate"))

#: text_mode -> a new request's detokenizer (``step(tokens)``/``finish()``); the tags need none.
_TEXT_MODES: dict[_engine_args.TextMode, Callable[[], Any]] = {
    _engine_args.TextMode.BYTES: ByteDetokenizer,
    _engine_args.TextMode.WORDS: WordText,
}


# --- lifetime --------------------------------------------------------------------------------------------


def _open_publishers(prepared: PreparedConfig) -> list[Any]:
    """docs/reference/mock.md#startup-and-shutdown step 2: one PUB (and optional replay ROUTER) per rank on the listen IP, all or nothing."""
    args = prepared.args
    if not args.enable_prefix_caching or prepared.mode in (Role.DECODE, Role.ENCODE):
        return []
    from trio_sidecar.mock import kv_events

    try:
        return kv_events.bind_publishers(
            prepared.host, len(args.local_ranks), port=args.zmq_kv_events_port, replay_port=args.zmq_replay_port
        )
    except OSError as exc:
        LOGGER.warning("running without KV events: %s", exc)
        return []


@asynccontextmanager
async def open_mock_server(config: MockConfig) -> AsyncIterator[MockServer]:
    """Run a mock vLLM gRPC server for the duration of the block.

    Args:
        config: the server configuration (``listen="127.0.0.1:0"`` picks a free port).

    Returns:
        The running :class:`MockServer` (``.address``, ``.port`` and the hooks of docs/reference/mock.md#in-process-api-and-test-hooks).

    Raises:
        MockConfigError: an invalid configuration (nothing was bound).
        OSError: the gRPC listen address cannot be bound.

    Resource handling: the engines and the gRPC server live in a nursery owned by the block; leaving the
    block cancels them and closes every socket, including the ZMQ ones.
    """
    from trio_sidecar.mock.scheduler import RankEngine

    prepared = prepare_config(config)
    publishers = _open_publishers(prepared)
    try:
        with collapse_single_exception():
            async with trio.open_nursery() as nursery:
                engines = [
                    RankEngine(rank, prepared.args, publishers[index] if publishers else None)
                    for index, rank in enumerate(prepared.args.local_ranks)
                ]
                for engine in engines:
                    await nursery.start(engine.run)
                for pub in publishers:
                    await nursery.start(pub.run)
                server = MockServer(prepared, engines, publishers)
                listener = await nursery.start(
                    partial(
                        serve_grpc,
                        [InferenceServicer(server), ControlServicer(server), server.health],
                        host=prepared.host,
                        port=prepared.port,
                        max_message_length=DEFAULT_MAX_MESSAGE_LENGTH,
                        limits=prepared.limits,
                    )
                )
                server.port = listener.port
                LOGGER.info(
                    "starting mock vLLM gRPC server listen=%s model=%s mode=%s dp_size=%d",
                    server.address,
                    config.model,
                    prepared.mode.value,
                    prepared.args.dp_size,
                )
                yield server
                nursery.cancel_scope.cancel()
    finally:
        for pub in publishers:
            pub.close()


async def serve_mock(
    config: MockConfig, *, task_status: trio.TaskStatus[MockServer] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Run a mock server until cancelled: ``mock = await nursery.start(serve_mock, config)``.

    ``task_status.started`` receives the running :class:`MockServer`. Raises as :func:`open_mock_server`.
    """
    async with open_mock_server(config) as server:
        task_status.started(server)
        await trio.sleep_forever()
