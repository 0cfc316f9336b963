"""The continuous health prober: the I/O adapter of :class:`~trio_sidecar.core.health_policy.HealthPolicy`
(docs/reference/sidecar.md#health-prober, docs/reference/sidecar.md#recovery,
docs/reference/real-vllm.md#shutdown-and-engine-death).

Theory of operation
-------------------

The prober is one task in ``open_sidecar``'s nursery. It never decides anything itself: every decision
(what to publish, when to reconnect, when to recover, when a dropped connection is only a hiccup) is the
policy's (see ``health_policy.py``). This module does the I/O the policy asks for and reports what
happened as events:

* ``Connect``: one connect attempt with the pool's per-attempt rules (``connect_attempt_timeout``) on a
  *dedicated* connection (never a pool slot), then ``Health.Watch`` for ``vllm.Control`` and
  ``vllm.Inference`` concurrently. Each watcher only reports (status, end, failure). A watcher whose
  ``Watch`` is ``UNIMPLEMENTED`` polls ``Health.Check`` every ``retry_interval`` instead and reports the
  same way. A watch failure caused by the connection's keepalive (the peer stopped answering PINGs) is
  reported as ``EndCause.HUNG``.
* ``StartRecovery``: rediscovery on the session's connection (``discover_model``, then
  ``fetch_kv_event_sources``, each RPC bounded by ``connect_attempt_timeout``); its outcome comes back as a
  value, never as an exception through a nursery, so a single failure never surfaces as an
  ``ExceptionGroup``.
* ``Adopt``: ``on_recovered(model, sources)`` (an exception from it is fatal); ``Publish``: the
  ``health`` value the engine's admission reads, counted in the stats and logged; timers: deadlines on
  Trio's clock; ``Fatal``: end every session and raise out of :func:`run_health_prober`.

Events of a session that already ended are dropped by the policy (each carries its session number), and
so is the outcome of an abandoned recovery attempt.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import attrs
import trio
import trio_util

from .._proto.grpc.health.v1 import health_pb2
from ..core.config import SidecarConfig
from ..core.endpoint import GrpcEndpoint
from ..core.errors import CannotConnect, ConnectionTimeout, ProtocolError, SidecarError, format_status
from ..core.health_policy import (
    SERVICES,
    AbandonRecovery,
    Adopt,
    Adopted,
    AdoptionFailed,
    ArmTimer,
    CancelTimer,
    Connect,
    Connected,
    ConnectFailed,
    EndCause,
    EndSession,
    Fatal,
    HealthAction,
    HealthEvent,
    HealthKind,
    HealthPolicy,
    HealthState,
    Publish,
    RecoveryDone,
    RecoveryFailed,
    StartRecovery,
    StatusReceived,
    Timer,
    TimerFired,
    WatchEnded,
    compare_models,
    hung_engine_deadline,
)
from ..core.model import DiscoveredModel
from ..core.routing import KvEventSource
from ..core.stats import SidecarStats
from ..core.status import StatusCode
from ..transport import Channel, RpcError, connect_channel
from .discovery import HEALTH_CHECK, discover_model, fetch_kv_event_sources
from .pool import ChannelPool, cause_chain, channel_options

__all__ = ["run_health_prober"]

LOGGER = logging.getLogger("trio_sidecar.prober")

# Translated gRPC failures of a rediscovery RPC that mean "vLLM cannot be reached" rather than "not ready"
# (UNAVAILABLE, a lost connection, DEADLINE_EXCEEDED).
_UNREACHABLE_ERRORS = (CannotConnect, ConnectionTimeout)
# Socket-level failures the transport may let through besides RpcError (a reset during the HTTP/2 preface
# surfaces as trio.BrokenResourceError).
_IO_ERRORS: tuple[type[BaseException], ...] = (OSError, trio.BrokenResourceError, SidecarError, RpcError)
# How the transport names a connection its keepalive lost (transport/_connection.py): the peer stopped
# answering, which is the hung-engine deadline and never a hiccup.
_KEEPALIVE_LOST = "keepalive PING not acknowledged"
WATCH = "/grpc.health.v1.Health/Watch"


def _detail(exc: BaseException) -> str:
    """A failed health call's detail: the gRPC status (``{message} ({Code})``) or the cause chain."""
    if isinstance(exc, SidecarError) and exc.grpc_code is not None:
        return format_status(exc.grpc_code, exc.grpc_message)
    return cause_chain(exc)


def _failure(service: str, call: str, session: int, exc: BaseException) -> WatchEnded:
    detail = _detail(exc)
    cause = EndCause.HUNG if _KEEPALIVE_LOST in detail else EndCause.FAILED
    return WatchEnded(session, cause, f"{service} {call} failed: {detail}")


@attrs.define
class _Session:
    """What runs on one connection: its scope (``EndSession`` cancels it), pool and task nursery."""

    number: int
    scope: trio.CancelScope
    pool: ChannelPool | None = None
    nursery: trio.Nursery | None = None
    recovery: trio.CancelScope | None = None


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
        self.health = health
        self.on_recovered = on_recovered
        self.policy = HealthPolicy(
            model=model,
            kv_sources=tuple(kv_sources),
            connect_attempt_timeout=config.connect_attempt_timeout,
            retry_interval=config.retry_interval,
            hiccup_deadline=hung_engine_deadline(
                connect_attempt_timeout=config.connect_attempt_timeout,
                keepalive_time=config.keepalive_time,
                keepalive_timeout=config.keepalive_timeout,
            ),
            published=health.value,
        )
        self.timers: dict[Timer, float] = {}
        self.session: _Session | None = None
        self._send, self._receive = trio.open_memory_channel[HealthEvent](math.inf)

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self) -> NoReturn:
        async with trio.open_nursery() as nursery:
            fatal = await self._loop(nursery)
            nursery.cancel_scope.cancel()
        # Raised outside every nursery: a single failure never surfaces as an ExceptionGroup.
        raise fatal

    async def _loop(self, nursery: trio.Nursery) -> Exception:
        pending: deque[HealthAction] = deque(self.policy.start())
        while True:
            while pending:
                action = pending.popleft()
                if isinstance(action, Fatal):
                    return action.error
                event = self._execute(action, nursery)
                if event is not None:
                    pending.extend(self.policy.handle(event))
            due = min(self.timers.values(), default=math.inf)
            received: HealthEvent | None = None
            try:
                received = self._receive.receive_nowait()  # events already here come before due timers
            except trio.WouldBlock:
                with trio.move_on_at(due):
                    received = await self._receive.receive()
            if received is None:
                timer = min(self.timers, key=self.timers.__getitem__)
                del self.timers[timer]
                received = TimerFired(timer)
            pending.extend(self.policy.handle(received))

    def _execute(self, action: HealthAction, nursery: trio.Nursery) -> HealthEvent | None:
        """Carry out one action; returns the event it produced at once, if any (``Adopt``)."""
        if isinstance(action, Publish):
            self._publish(action)
        elif isinstance(action, ArmTimer):
            self.timers[action.timer] = trio.current_time() + action.delay
        elif isinstance(action, CancelTimer):
            self.timers.pop(action.timer, None)
        elif isinstance(action, Connect):
            if action.after_hiccup is not None:
                LOGGER.info("health prober: %s; reconnecting at once (admission stays open)", action.after_hiccup)
            self.session = _Session(action.session, trio.CancelScope())
            nursery.start_soon(self._run_session, self.session)
        elif isinstance(action, EndSession):
            if self.session is not None:
                self.session.scope.cancel()
                self.session = None
        elif isinstance(action, StartRecovery):
            session = self.session
            assert session is not None and session.pool is not None and session.nursery is not None
            session.recovery = trio.CancelScope()
            session.nursery.start_soon(self._recover, session.pool, action.attempt, session.recovery)
        elif isinstance(action, AbandonRecovery):
            if self.session is not None and self.session.recovery is not None:
                self.session.recovery.cancel()
        elif isinstance(action, Adopt):
            return self._adopt(action)
        return None

    def _publish(self, action: Publish) -> None:
        state = action.state
        if state.kind is not self.health.value.kind:
            self.stats.health_changed(state.kind.value)
        if action.warn:
            LOGGER.warning("vLLM is not serving (%s); new requests are rejected", state.reason)
        elif state.kind is not HealthKind.SERVING:
            LOGGER.debug("vLLM health: %s (%s)", state.kind.name, state.reason)
        self.health.value = state

    def _adopt(self, action: Adopt) -> HealthEvent:
        if action.sources != action.previous_sources:
            LOGGER.warning(
                "KV-event sources changed after vLLM recovery; replacing them: %s -> %s",
                [s.endpoint for s in action.previous_sources],
                [s.endpoint for s in action.sources],
            )
        try:
            self.on_recovered(action.model, action.sources)
        except Exception as exc:  # fatal, raised outside the nursery
            return AdoptionFailed(exc)
        LOGGER.info("vLLM is serving again (instance %s → %s)", action.previous.instance_id, action.model.instance_id)
        return Adopted()

    # --- sessions -----------------------------------------------------------------------------------

    async def _run_session(self, session: _Session) -> None:
        send = self._send
        with session.scope:
            async with trio.open_nursery() as conn_nursery:
                channel = await self._connect(conn_nursery, session.number)
                if channel is not None:
                    # A dedicated pool of this one connection: the pool is the edge for gRPC errors, and a
                    # broken connection is not replaced under the session (its calls fail; the policy
                    # starts a new session).
                    pool = ChannelPool(conn_nursery, self.endpoint, self.config, [channel], reconnect=False)
                    try:
                        async with trio.open_nursery() as work:
                            session.pool, session.nursery = pool, work
                            send.send_nowait(Connected(session.number))
                            for service in SERVICES:
                                work.start_soon(self._watch, pool, session.number, service)
                            await trio.sleep_forever()  # until EndSession: recoveries start here
                    finally:
                        await pool.aclose()  # (shielded)
                conn_nursery.cancel_scope.cancel()

    async def _connect(self, nursery: trio.Nursery, session: int) -> Channel | None:
        """One connect attempt with the pool's rules (docs/reference/sidecar.md#construction-and-retries);
        ``None`` (and ``ConnectFailed``) on failure."""
        cause = "the connection attempt timed out"
        with trio.move_on_after(self.config.connect_attempt_timeout):
            try:
                return await connect_channel(
                    nursery, self.endpoint.host, self.endpoint.port, **channel_options(self.config)
                )
            except _IO_ERRORS as exc:
                cause = cause_chain(exc)
        self._send.send_nowait(ConnectFailed(session, f"cannot connect to {self.endpoint.canonical}: {cause}"))
        return None

    async def _watch(self, pool: ChannelPool, session: int, service: str) -> None:
        send = self._send
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            async with pool.stream("Health.Watch", WATCH, request, health_pb2.HealthCheckResponse) as responses:
                async for response in responses:
                    send.send_nowait(StatusReceived(session, service, int(response.status)))
        except SidecarError as exc:
            if exc.grpc_code == StatusCode.UNIMPLEMENTED:
                await self._poll(pool, session, service)
                return
            send.send_nowait(_failure(service, "Health.Watch", session, exc))
        except _IO_ERRORS as exc:
            send.send_nowait(_failure(service, "Health.Watch", session, exc))
        else:
            send.send_nowait(WatchEnded(session, EndCause.ENDED, ""))

    async def _poll(self, pool: ChannelPool, session: int, service: str) -> None:
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
            except _IO_ERRORS as exc:
                self._send.send_nowait(_failure(service, "Health.Check", session, exc))
                return
            self._send.send_nowait(StatusReceived(session, service, int(response.status), via_check=True))
            await trio.sleep(cfg.retry_interval)

    # --- recovery (docs/reference/sidecar.md#recovery) ----------------------------------------------

    async def _recover(self, pool: ChannelPool, attempt: int, scope: trio.CancelScope) -> None:
        with scope:
            self._send.send_nowait(await self._rediscover(pool, attempt))

    async def _rediscover(self, pool: ChannelPool, attempt: int) -> HealthEvent:
        """Discovery again, each RPC bounded by ``connect_attempt_timeout``; an outcome, never an exception."""
        timeout = self.config.connect_attempt_timeout
        try:
            observed = await discover_model(pool, deadline=math.inf, timeout=timeout)
            if compare_models(self.policy.model, observed) is not None:
                return RecoveryDone(attempt, observed, ())  # fatal for the policy; its sources do not matter
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
            return RecoveryDone(attempt, observed, tuple(sources))
        LOGGER.debug("vLLM recovery attempt failed: %s", state.reason)
        return RecoveryFailed(attempt, state)


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
            rediscovery RPC; ``retry_interval`` spaces reconnects after an outage, Check polls and recovery
            retries; ``keepalive_time`` / ``keepalive_timeout`` bound how long a hung vLLM goes unnoticed
            and how long a reconnect after a hiccup may keep admission open.
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
