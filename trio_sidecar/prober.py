"""The continuous health prober (docs/reference/sidecar.md#health-prober, docs/reference/sidecar.md#recovery, docs/reference/real-vllm.md#shutdown-and-engine-death, docs/reference/sidecar.md#prober-states).

Theory of operation
-------------------

The prober is one task in ``open_sidecar``'s nursery. It owns a *dedicated* connection to vLLM (never a
pool slot) and publishes its view in ``health``, an ``AsyncValue[HealthState]`` that the admission gate of
the engine reads. It never cancels in-flight requests; it only opens and closes admission.

One *session* is the lifetime of one connection:

1. Connect with the pool's per-attempt rules (``connect_attempt_timeout`` per attempt, a fixed
   ``retry_interval`` between attempts, no overall deadline). A failed attempt publishes
   ``UNREACHABLE(detail)``.
2. Open ``Health.Watch`` for ``vllm.Control`` and ``vllm.Inference`` concurrently. Each watcher only
   *reports* (status, end, error) over a memory channel to the session's coordinator, which alone decides
   the state. A watcher whose ``Watch`` is ``UNIMPLEMENTED`` polls ``Health.Check`` every
   ``retry_interval`` instead and reports the same way.
3. Both first statuses must arrive within ``connect_attempt_timeout``. Afterwards the combined state is
   ``SERVING`` only while both latest statuses are ``SERVING``; any other status closes admission with
   ``NOT_SERVING``.
4. A stream that ends with OK (vLLM's graceful shutdown) or fails ends the session
   (``NOT_SERVING("vLLM Health.Watch ended")`` / ``UNREACHABLE(detail)``); after ``retry_interval`` a
   new session starts.
5. ``Watch`` is silent while nothing changes, so silence alone proves nothing: the connection's keepalive
   (``keepalive_time`` / ``keepalive_timeout``, the pool's settings) PINGs it after ``keepalive_time``
   without reads, and a hung vLLM (stopped, wedged) that does not answer fails both watchers with
   ``UNAVAILABLE``, i.e. ``UNREACHABLE``, within ``keepalive_time + keepalive_timeout``.

Recovery (docs/reference/sidecar.md#recovery) starts whenever both services report ``SERVING`` while the published state is not
``SERVING``: the state becomes ``RECOVERING`` and a recovery task rediscovers the model on the prober's
connection. A status change away from ``SERVING`` cancels it. Its outcome comes back to the coordinator
as a value (never as an exception through the session nursery, so a single failure never surfaces as an
``ExceptionGroup``):

* same identity and DP size → ``on_recovered(model, sources)``, then ``SERVING`` (changed KV-event
  sources are not fatal, docs/reference/sidecar.md#recovery: a warning, and the caller replaces its publishers);
* changed identity or DP size → ``FAILED`` and the fatal :class:`~trio_sidecar.errors.ProtocolError`
  leaves :func:`run_health_prober` (and so ``open_sidecar``);
* a transient failure → ``NOT_SERVING``/``UNREACHABLE``; retried ``retry_interval`` later while both
  services still report ``SERVING``.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import NoReturn

import attrs
import trio
import trio_util

from ._proto.grpc.health.v1 import health_pb2
from .config import SidecarConfig
from .discovery import HEALTH_CHECK, discover_model, fetch_kv_event_sources
from .endpoint import GrpcEndpoint
from .errors import CannotConnect, ConnectionTimeout, ProtocolError, SidecarError, format_status
from .model import DiscoveredModel
from .pool import ChannelPool, cause_chain, channel_options
from .routing import KvEventSource
from .stats import SidecarStats
from .status import StatusCode
from .transport import Channel, RpcError, connect_channel

__all__ = [
    "HealthKind",
    "HealthState",
    "run_health_prober",
    "SERVICES",
    "WATCH_TIMED_OUT",
    "WATCH_NOT_SERVING",
    "WATCH_ENDED",
    "CHECK_NOT_SERVING",
]

LOGGER = logging.getLogger("trio_sidecar.prober")

SERVICES: tuple[str, ...] = ("vllm.Control", "vllm.Inference")
_SERVING = health_pb2.HealthCheckResponse.SERVING

# Fixed reasons (docs/reference/sidecar.md#watching). The Check fallback has its own text (the original design only named Watch's).
WATCH_TIMED_OUT = "Health.Watch initial status timed out"
WATCH_NOT_SERVING = "vLLM Health.Watch is not SERVING"
WATCH_ENDED = "vLLM Health.Watch ended"
CHECK_NOT_SERVING = "vLLM Health.Check is not SERVING"


class HealthKind(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    UNREACHABLE = "unreachable"
    RECOVERING = "recovering"
    FAILED = "failed"


@attrs.frozen
class HealthState:
    """What the prober knows about vLLM. Admission is open only for ``SERVING``."""

    kind: HealthKind
    reason: str = ""

    @property
    def admits(self) -> bool:
        return self.kind is HealthKind.SERVING


SERVING_STATE = HealthState(HealthKind.SERVING)
RECOVERING_STATE = HealthState(HealthKind.RECOVERING)
_CLOSED_KINDS = frozenset({HealthKind.NOT_SERVING, HealthKind.UNREACHABLE})
# Translated gRPC failures of a rediscovery RPC that mean "vLLM cannot be reached" rather than "not ready"
# (UNAVAILABLE, a lost connection, DEADLINE_EXCEEDED).
_UNREACHABLE_ERRORS = (CannotConnect, ConnectionTimeout)
# Socket-level failures the transport may let through besides RpcError (a reset during the HTTP/2 preface
# surfaces as trio.BrokenResourceError).
_IO_ERRORS: tuple[type[BaseException], ...] = (OSError, trio.BrokenResourceError, SidecarError, RpcError)
WATCH = "/grpc.health.v1.Health/Watch"


def _detail(exc: BaseException) -> str:
    """A failed health call's detail: the gRPC status (``{message} ({Code})``) or the cause chain."""
    if isinstance(exc, SidecarError) and exc.grpc_code is not None:
        return format_status(exc.grpc_code, exc.grpc_message)
    return cause_chain(exc)


# --- events from the session's tasks to its coordinator -------------------------------------------------


@attrs.frozen
class _Status:
    service: str
    status: int
    via_check: bool = False


@attrs.frozen
class _SessionEnd:
    """A watcher is over; the session ends with ``state``."""

    state: HealthState


@attrs.frozen
class _RecoveryDone:
    attempt: int
    model: DiscoveredModel
    sources: tuple[KvEventSource, ...]


@attrs.frozen
class _RecoveryFailed:
    attempt: int
    state: HealthState


@attrs.frozen
class _RecoveryFatal:
    attempt: int
    error: ProtocolError


_Event = _Status | _SessionEnd | _RecoveryDone | _RecoveryFailed | _RecoveryFatal


class _Prober:
    def __init__(
        self,
        *,
        endpoint: GrpcEndpoint,
        config: SidecarConfig,
        model: DiscoveredModel,
        kv_sources: tuple[KvEventSource, ...],
        health: trio_util.AsyncValue[HealthState],
        on_recovered: Callable[[DiscoveredModel, tuple[KvEventSource, ...]], None],
        stats: SidecarStats,
    ) -> None:
        self.stats = stats
        self.endpoint = endpoint
        self.config = config
        self.model = model
        self.kv_sources = tuple(kv_sources)
        self.health = health
        self.on_recovered = on_recovered
        self._warned_kind: HealthKind | None = None

    # --- publishing ---------------------------------------------------------------------------------

    def publish(self, state: HealthState) -> None:
        current = self.health.value
        if state == current:
            return
        if state.kind is not current.kind:
            self.stats.health_changed(state.kind.value)
        if state.kind in _CLOSED_KINDS and self._warned_kind is not state.kind:
            LOGGER.warning("vLLM is not serving (%s); new requests are rejected", state.reason)
            self._warned_kind = state.kind
        elif state.kind is HealthKind.SERVING:
            self._warned_kind = None
        else:
            LOGGER.debug("vLLM health: %s (%s)", state.kind.name, state.reason)
        self.health.value = state

    def close_admission(self, state: HealthState) -> None:
        """Publish a non-serving state (never over ``FAILED``, which is final)."""
        if self.health.value.kind is not HealthKind.FAILED:
            self.publish(state)

    # --- sessions -----------------------------------------------------------------------------------

    async def run(self) -> NoReturn:
        while True:
            fatal: BaseException | None = None
            async with trio.open_nursery() as conn_nursery:
                channel = await self.connect(conn_nursery)
                if channel is not None:
                    # A dedicated pool of this one connection: the pool is the edge for gRPC errors, and a
                    # broken connection is not replaced under the session (its calls fail; a new session
                    # connects again).
                    pool = ChannelPool(conn_nursery, self.endpoint, self.config, [channel], reconnect=False)
                    try:
                        fatal = await self.session(pool)
                    finally:
                        await pool.aclose()  # (shielded)
                conn_nursery.cancel_scope.cancel()
            if fatal is not None:
                # Raised outside every nursery: a single failure never surfaces as an ExceptionGroup.
                self.publish(HealthState(HealthKind.FAILED, str(fatal)))
                raise fatal
            await trio.sleep(self.config.retry_interval)

    async def connect(self, nursery: trio.Nursery) -> Channel | None:
        """One connect attempt with the pool's rules (docs/reference/sidecar.md#construction-and-retries); ``None`` (and UNREACHABLE) on failure."""
        cause = "the connection attempt timed out"
        with trio.move_on_after(self.config.connect_attempt_timeout):
            try:
                return await connect_channel(
                    nursery, self.endpoint.host, self.endpoint.port, **channel_options(self.config)
                )
            except _IO_ERRORS as exc:
                cause = cause_chain(exc)
        self.close_admission(
            HealthState(HealthKind.UNREACHABLE, f"cannot connect to {self.endpoint.canonical}: {cause}")
        )
        return None

    async def session(self, pool: ChannelPool) -> BaseException | None:
        """Watch both services on ``pool``'s connection until the session ends; returns a fatal error, if any.

        The coordinator (this function) alone changes ``health``; watchers and recovery attempts only
        send events. Each recovery attempt carries a number, and an outcome that arrives after its attempt
        was abandoned (a status changed meanwhile) is ignored, so a stale success never reopens admission.
        """
        cfg = self.config
        send, receive = trio.open_memory_channel[_Event](math.inf)
        latest: dict[str, int | None] = dict.fromkeys(SERVICES)
        fatal: BaseException | None = None
        attempt = 0  # the current recovery attempt; 0 = none running
        attempts = 0
        recovery_scope = trio.CancelScope()
        retry_recovery_at = math.inf
        initial_deadline = trio.current_time() + cfg.connect_attempt_timeout
        not_serving = WATCH_NOT_SERVING

        def all_serving() -> bool:
            return all(status == _SERVING for status in latest.values())

        def abandon_recovery() -> None:
            nonlocal attempt, retry_recovery_at
            recovery_scope.cancel()
            attempt = 0
            retry_recovery_at = math.inf

        async with send, receive, trio.open_nursery() as nursery:
            for service in SERVICES:
                nursery.start_soon(self.watch, pool, service, send.clone())

            def start_recovery() -> None:
                nonlocal attempt, attempts, recovery_scope, retry_recovery_at
                attempts += 1
                attempt = attempts
                retry_recovery_at = math.inf
                recovery_scope = trio.CancelScope()
                self.publish(RECOVERING_STATE)
                nursery.start_soon(self.recover, pool, attempt, recovery_scope, send.clone())

            while True:
                waiting_initial = any(status is None for status in latest.values())
                event: _Event | None = None
                with trio.move_on_at(initial_deadline if waiting_initial else retry_recovery_at):
                    event = await receive.receive()

                if event is None:
                    if waiting_initial:
                        self.close_admission(HealthState(HealthKind.UNREACHABLE, WATCH_TIMED_OUT))
                        break
                    # The retry after a transient recovery failure (docs/reference/sidecar.md#recovery).
                    retry_recovery_at = math.inf
                    if attempt == 0 and all_serving() and self.health.value.kind is not HealthKind.SERVING:
                        start_recovery()
                elif isinstance(event, _SessionEnd):
                    self.close_admission(event.state)
                    break
                elif isinstance(event, (_RecoveryDone, _RecoveryFailed, _RecoveryFatal)):
                    if event.attempt != attempt:
                        continue  # abandoned meanwhile
                    attempt = 0
                    if isinstance(event, _RecoveryFatal):
                        fatal = event.error
                        break
                    if isinstance(event, _RecoveryFailed):
                        self.close_admission(event.state)
                        retry_recovery_at = trio.current_time() + cfg.retry_interval
                        continue
                    try:
                        self.finish_recovery(event.model, event.sources)
                    except Exception as exc:  # from on_recovered: fatal, raised outside the nursery
                        fatal = exc
                        break
                else:
                    latest[event.service] = event.status
                    not_serving = CHECK_NOT_SERVING if event.via_check else WATCH_NOT_SERVING
                    if event.status != _SERVING:
                        abandon_recovery()
                        self.close_admission(HealthState(HealthKind.NOT_SERVING, not_serving))
                    elif all_serving() and attempt == 0 and self.health.value.kind is not HealthKind.SERVING:
                        start_recovery()
            nursery.cancel_scope.cancel()
        return fatal

    # --- watchers -----------------------------------------------------------------------------------

    async def watch(self, pool: ChannelPool, service: str, send: trio.MemorySendChannel[_Event]) -> None:
        async with send:
            request = health_pb2.HealthCheckRequest(service=service)
            try:
                async with pool.stream("Health.Watch", WATCH, request, health_pb2.HealthCheckResponse) as responses:
                    async for response in responses:
                        await send.send(_Status(service, int(response.status)))
            except SidecarError as exc:
                if exc.grpc_code == StatusCode.UNIMPLEMENTED:
                    await self.poll(pool, service, send)
                    return
                reason = f"{service} Health.Watch failed: {_detail(exc)}"
                await send.send(_SessionEnd(HealthState(HealthKind.UNREACHABLE, reason)))
            except _IO_ERRORS as exc:
                reason = f"{service} Health.Watch failed: {_detail(exc)}"
                await send.send(_SessionEnd(HealthState(HealthKind.UNREACHABLE, reason)))
            else:
                await send.send(_SessionEnd(HealthState(HealthKind.NOT_SERVING, WATCH_ENDED)))

    async def poll(self, pool: ChannelPool, service: str, send: trio.MemorySendChannel[_Event]) -> None:
        """The ``Health.Check`` fallback for a server without ``Watch`` (docs/reference/sidecar.md#watching)."""
        cfg = self.config
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            try:
                response = await pool.unary(
                    "Health.Check",
                    HEALTH_CHECK,
                    request,
                    health_pb2.HealthCheckResponse,
                    timeout=cfg.connect_attempt_timeout,
                )
                status = response.status
            except _IO_ERRORS as exc:
                reason = f"{service} Health.Check failed: {_detail(exc)}"
                await send.send(_SessionEnd(HealthState(HealthKind.UNREACHABLE, reason)))
                return
            await send.send(_Status(service, int(status), via_check=True))
            await trio.sleep(cfg.retry_interval)

    # --- recovery (docs/reference/sidecar.md#recovery) ---------------------------------------------------------------------------

    async def recover(
        self, pool: ChannelPool, attempt: int, scope: trio.CancelScope, send: trio.MemorySendChannel[_Event]
    ) -> None:
        async with send:
            with scope:
                outcome = await self._rediscover(pool, attempt)
                await send.send(outcome)

    async def _rediscover(self, pool: ChannelPool, attempt: int) -> _Event:
        """Discovery again (``discover_model``, then ``fetch_kv_event_sources``), each RPC bounded by
        ``connect_attempt_timeout``; an outcome, never an exception."""
        timeout = self.config.connect_attempt_timeout
        try:
            observed = await discover_model(pool, deadline=math.inf, timeout=timeout)
            fatal = self._compare(observed)
            if fatal is not None:
                return _RecoveryFatal(attempt, fatal)
            sources = await fetch_kv_event_sources(pool, self.endpoint, observed, deadline=math.inf, timeout=timeout)
        except ProtocolError as exc:  # a half-started server may answer blanks: not a verdict yet
            state = HealthState(HealthKind.NOT_SERVING, exc.message)
        except _UNREACHABLE_ERRORS as exc:
            state = HealthState(HealthKind.UNREACHABLE, str(exc))
        except SidecarError as exc:  # another gRPC status: vLLM answers, but is not ready
            state = HealthState(HealthKind.NOT_SERVING, str(exc))
        except _IO_ERRORS as exc:
            state = HealthState(HealthKind.UNREACHABLE, f"rediscovery failed: {cause_chain(exc)}")
        else:
            return _RecoveryDone(attempt, observed, tuple(sources))
        LOGGER.debug("vLLM recovery attempt failed: %s", state.reason)
        return _RecoveryFailed(attempt, state)

    def _compare(self, observed: DiscoveredModel) -> ProtocolError | None:
        """The recovery comparison (docs/reference/sidecar.md#recovery): identity and DP size; KV sources may change."""
        expected = self.model
        if observed.identity != expected.identity:
            return ProtocolError(
                f"model identity changed after vLLM recovery: expected {expected.identity!r}, "
                f"observed {observed.identity!r}"
            )
        if observed.data_parallel_size() != expected.data_parallel_size():
            return ProtocolError(
                "data-parallel size changed after vLLM recovery: "
                f"expected {expected.data_parallel_size()}, observed {observed.data_parallel_size()}"
            )
        return None

    def finish_recovery(self, observed: DiscoveredModel, sources: tuple[KvEventSource, ...]) -> None:
        old_instance = self.model.server_info.instance_id
        if sources != self.kv_sources:
            LOGGER.warning(
                "KV-event sources changed after vLLM recovery; replacing them: %s -> %s",
                [s.endpoint for s in self.kv_sources],
                [s.endpoint for s in sources],
            )
        self.on_recovered(observed, sources)
        self.model = observed
        self.kv_sources = sources
        LOGGER.info("vLLM is serving again (instance %s → %s)", old_instance, observed.server_info.instance_id)
        self.publish(SERVING_STATE)


async def run_health_prober(
    *,
    endpoint: GrpcEndpoint,
    config: SidecarConfig,
    model: DiscoveredModel,
    kv_sources: tuple[KvEventSource, ...],
    health: trio_util.AsyncValue[HealthState],
    on_recovered: Callable[[DiscoveredModel, tuple[KvEventSource, ...]], None],
    stats: SidecarStats | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Watch vLLM's health until cancelled (docs/reference/sidecar.md#health-prober).

    Args:
        endpoint: where vLLM listens; the prober opens its own connection there.
        config: ``connect_attempt_timeout`` bounds each connect attempt, each first Watch status and each
            rediscovery RPC; ``retry_interval`` spaces reconnects, Check polls and recovery retries;
            ``keepalive_time`` / ``keepalive_timeout`` bound how long a hung vLLM goes unnoticed.
        model: the model found at start; recovery compares identity and DP size against it.
        kv_sources: the KV-event sources found at start (already rewritten, docs/reference/sidecar.md#kv-event-sources).
        health: published state; the caller initialises it (``SERVING`` after a successful start).
        on_recovered: called synchronously after every successful recovery, just before ``SERVING`` is
            published, with the rediscovered model (its ``instance_id`` may be new) and the rewritten
            KV-event sources (which may differ from the previous ones, docs/reference/sidecar.md#recovery: the caller
            replaces its publishers then). An exception from it propagates out of the prober.
        stats: where each change of the published state's kind is counted (docs/observability.md); the
            engine's, else a fresh one.

    Returns:
        Never.

    Raises:
        ProtocolError: ``model identity changed after vLLM recovery: ...`` or ``data-parallel size changed
            after vLLM recovery: ...``; ``health`` is ``FAILED`` with the same message first.

    Cancellation:
        Cancelling the caller's scope stops the prober; its connection is closed (shielded).
    """
    prober = _Prober(
        endpoint=endpoint,
        config=config,
        model=model,
        kv_sources=kv_sources,
        health=health,
        on_recovered=on_recovered,
        stats=stats if stats is not None else SidecarStats(),
    )
    task_status.started()
    await prober.run()
