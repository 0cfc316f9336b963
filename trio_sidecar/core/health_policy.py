"""The health policy: what the prober decides (docs/reference/sidecar.md#health-prober). PURE: no Trio, no
I/O, no clock.

Theory of operation
-------------------

Two machines, in the style of h11's ``Connection``: the caller feeds an *event* (something that happened)
to ``handle()`` and gets back a list of *actions* (what to do now), which it carries out in order. Neither
machine ever waits, reads a clock or touches a socket; timers are actions too (``ArmTimer``/``CancelTimer``)
and come back as ``TimerFired`` events. Every decision is therefore a plain function of the events so far,
and ``tests/prober/test_health_policy.py`` checks each transition as a table row.

:class:`HealthPolicy` runs inside every sidecar (the embedded API too); its I/O adapter is
``prober.py``, which owns the connection, the two ``Health.Watch`` streams, the rediscovery RPCs and the
timers. It publishes :class:`HealthState` (admission is open only in ``SERVING``):

* A *session* is one connection with its two watches. ``Connected`` arms the first-status deadline
  (``connect_attempt_timeout``); both first statuses establish the session.
* Any status other than ``SERVING`` closes admission (``NOT_SERVING``) and abandons a running recovery.
* Both services ``SERVING`` while the published state is not ``SERVING`` starts a *recovery*
  (``RECOVERING``, then rediscovery). Its outcome comes back as an event carrying the attempt number; an
  outcome of an abandoned attempt is ignored, so a stale success never reopens admission. The comparison
  with the started model is made here: a changed identity or DP size is ``FAILED`` and ``Fatal``; the same
  model is adopted (``Adopt``, the caller swaps its model and KV-event sources) and, once adopted,
  ``SERVING``; a transient failure closes admission and retries after ``retry_interval``.
* **A prober hiccup is not an outage.** When a watch ends or fails while the published state is
  ``SERVING`` (a GOAWAY, a reset or a proxy closing the prober's own connection, while the inference
  connections carry on), the session is ended and a new one starts *at once*, with admission left open.
  Admission closes only if the reconnect fails, a service reports ``NOT_SERVING``, or the new session is not
  established within the hung-engine deadline (``keepalive_time + keepalive_timeout``, at most
  ``connect_attempt_timeout``). Once both services report ``SERVING`` again, a *verification* (a recovery
  that does not close admission) checks that it is still the same vLLM: an unchanged instance ends the
  hiccup; a replaced one goes through ``RECOVERING`` and ``Adopt`` like any recovery, so every consumer of
  the published state sees it; a changed identity is fatal as always. A connection lost to the keepalive
  (``EndCause.HUNG``: the peer stopped answering) is never a hiccup, and at most one hiccup is forgiven per
  ``retry_interval``, so a server that keeps dropping the prober's connection is an outage.
* Any other session end closes admission (``NOT_SERVING("vLLM Health.Watch ended")`` for a watch that ended
  OK, ``UNREACHABLE(detail)`` otherwise) and the next session starts after ``retry_interval``.
* ``FAILED`` is final: nothing is published over it.

The worker's rotation (``dynamo/rotation.py``, :class:`~trio_sidecar.dynamo.rotation.RotationPolicy`) is a
second machine of the same kind, with the same timer actions, fed with the states published here. It is
separate because it lives elsewhere: the prober runs in every sidecar (the embedded API too), the rotation
only in the Dynamo worker, which sees the prober through the published state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

import attrs

from .._proto.grpc.health.v1 import health_pb2
from .errors import ProtocolError
from .model import DiscoveredModel
from .routing import KvEventSource

__all__ = [
    "HealthKind",
    "HealthState",
    "SERVING_STATE",
    "RECOVERING_STATE",
    "SERVICES",
    "WATCH_TIMED_OUT",
    "WATCH_NOT_SERVING",
    "WATCH_ENDED",
    "CHECK_NOT_SERVING",
    "HealthPolicy",
]

SERVICES: tuple[str, ...] = ("vllm.Control", "vllm.Inference")
SERVING = health_pb2.HealthCheckResponse.SERVING

# Fixed reasons (docs/reference/sidecar.md#prober-states). The Check fallback has its own text.
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
# The states announced with a warning (once per kind, until SERVING again).
_WARNED_KINDS = frozenset({HealthKind.NOT_SERVING, HealthKind.UNREACHABLE})


class Timer(enum.Enum):
    INITIAL_STATUS = "initial_status"  # both first statuses of a session are due
    RECONNECT = "reconnect"  # the next session after an outage
    RECOVERY_RETRY = "recovery_retry"  # the next recovery after a transient failure
    HICCUP_DEADLINE = "hiccup_deadline"  # the session after a hiccup must be established by then
    HICCUP_WINDOW = "hiccup_window"  # while armed, another hiccup is an outage
    GRACE = "grace"  # the worker's rotation: out of rotation when it fires


class EndCause(enum.Enum):
    """How a watch (or the Check fallback) ended."""

    ENDED = "ended"  # the stream ended with OK (vLLM's graceful shutdown)
    FAILED = "failed"  # an error status, a reset, a GOAWAY, a lost connection
    HUNG = "hung"  # the connection's keepalive found the peer silent: the hung-engine deadline


# --- events (in) ----------------------------------------------------------------------------------------


@attrs.frozen
class Connected:
    session: int


@attrs.frozen
class ConnectFailed:
    session: int
    reason: str  # ``cannot connect to {endpoint}: {cause}``


@attrs.frozen
class StatusReceived:
    session: int
    service: str
    status: int
    via_check: bool = False


@attrs.frozen
class WatchEnded:
    session: int
    cause: EndCause
    reason: str  # ``{service} Health.Watch failed: {detail}`` (unused for ``ENDED``)


@attrs.frozen
class RecoveryDone:
    attempt: int
    model: DiscoveredModel
    sources: tuple[KvEventSource, ...]


@attrs.frozen
class RecoveryFailed:
    attempt: int
    state: HealthState


@attrs.frozen
class Adopted:
    """The caller adopted the rediscovered model (``Adopt`` returned)."""


@attrs.frozen
class AdoptionFailed:
    error: Exception


@attrs.frozen
class TimerFired:
    timer: Timer


HealthEvent = (
    Connected
    | ConnectFailed
    | StatusReceived
    | WatchEnded
    | RecoveryDone
    | RecoveryFailed
    | Adopted
    | AdoptionFailed
    | TimerFired
)


# --- actions (out) --------------------------------------------------------------------------------------


@attrs.frozen
class Publish:
    state: HealthState
    warn: bool = False  # log ``vLLM is not serving ({reason}); new requests are rejected``


@attrs.frozen
class Connect:
    """Open a new connection and start session ``session`` on it (its watches start once connected)."""

    session: int
    after_hiccup: str | None = None  # the end that is being forgiven, for the log


@attrs.frozen
class EndSession:
    """Cancel the current session's watches and recovery, and close its connection."""


@attrs.frozen
class StartRecovery:
    attempt: int


@attrs.frozen
class AbandonRecovery:
    pass


@attrs.frozen
class ArmTimer:
    timer: Timer
    delay: float


@attrs.frozen
class CancelTimer:
    timer: Timer


@attrs.frozen
class Adopt:
    """Swap in the rediscovered model and KV-event sources, then report ``Adopted``/``AdoptionFailed``."""

    model: DiscoveredModel
    sources: tuple[KvEventSource, ...]
    previous: DiscoveredModel
    previous_sources: tuple[KvEventSource, ...]


@attrs.frozen
class Fatal:
    """Stop: end every session and raise ``error`` (``FAILED`` is already published)."""

    error: Exception


HealthAction = Publish | Connect | EndSession | StartRecovery | AbandonRecovery | ArmTimer | CancelTimer | Adopt | Fatal


def hung_engine_deadline(*, connect_attempt_timeout: float, keepalive_time: float, keepalive_timeout: float) -> float:
    """How long a hiccup may keep admission open: the keepalive's bound for a silent peer (at most the
    per-attempt timeout; the per-attempt timeout alone when keepalive is off)."""
    if keepalive_time <= 0:
        return connect_attempt_timeout
    return min(connect_attempt_timeout, keepalive_time + keepalive_timeout)


def compare_models(expected: DiscoveredModel, observed: DiscoveredModel) -> ProtocolError | None:
    """The recovery comparison (docs/reference/sidecar.md#recovery): identity and DP size; KV sources may change."""
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


class HealthPolicy:
    """The prober's decisions (see the module's theory of operation). Feed events to :meth:`handle`."""

    def __init__(
        self,
        *,
        model: DiscoveredModel,
        kv_sources: tuple[KvEventSource, ...],
        connect_attempt_timeout: float,
        retry_interval: float,
        hiccup_deadline: float,
        published: HealthState = SERVING_STATE,
    ) -> None:
        self.model = model
        self.kv_sources = tuple(kv_sources)
        self.connect_attempt_timeout = connect_attempt_timeout
        self.retry_interval = retry_interval
        self.hiccup_deadline = hiccup_deadline
        self.published = published
        self.sessions = 0  # sessions started so far
        self.session: int | None = None  # the live session's number; events of any other are stale
        self.watching = False  # the current session is connected (its watches run)
        self.established = False  # ... and both first statuses arrived
        self.latest: dict[str, int | None] = dict.fromkeys(SERVICES)
        self.not_serving = WATCH_NOT_SERVING
        self.attempt = 0  # the running recovery attempt; 0 = none
        self.attempts = 0
        self.verifying = False  # the running recovery keeps admission open (after a hiccup)
        self.hiccup: str | None = None  # the forgiven end, while its reconnect is not established
        self.adopting = False
        self.warned_kind: HealthKind | None = None
        self.armed: set[Timer] = set()

    def __repr__(self) -> str:
        return (
            f"<HealthPolicy {self.published.kind.name} session={self.session} watching={self.watching} "
            f"established={self.established} attempt={self.attempt} hiccup={self.hiccup is not None}>"
        )

    def start(self) -> list[HealthAction]:
        """The first actions: connect."""
        return self._connect()

    def handle(self, event: HealthEvent) -> list[HealthAction]:
        """The actions ``event`` calls for, in order. After ``FAILED`` every event calls for none."""
        if self.published.kind is HealthKind.FAILED:
            return []
        if isinstance(event, _SESSION_EVENTS) and event.session != self.session:
            return []  # from a session that already ended
        handler: Callable[[HealthPolicy, HealthEvent], list[HealthAction]] = _HANDLERS[type(event)]
        return handler(self, event)

    # --- helpers ----------------------------------------------------------------------------------------

    def _arm(self, timer: Timer, delay: float) -> list[HealthAction]:
        self.armed.add(timer)
        return [ArmTimer(timer, delay)]

    def _cancel(self, timer: Timer) -> list[HealthAction]:
        if timer not in self.armed:
            return []
        self.armed.discard(timer)
        return [CancelTimer(timer)]

    def _publish(self, state: HealthState) -> list[HealthAction]:
        if self.published.kind is HealthKind.FAILED or state == self.published:
            return []
        warn = state.kind in _WARNED_KINDS and self.warned_kind is not state.kind
        if warn:
            self.warned_kind = state.kind
        elif state.kind is HealthKind.SERVING:
            self.warned_kind = None
        self.published = state
        return [Publish(state, warn)]

    def _all_serving(self) -> bool:
        return all(status == SERVING for status in self.latest.values())

    def _connect(self, after_hiccup: str | None = None) -> list[HealthAction]:
        self.sessions += 1
        self.session = self.sessions
        self.watching = self.established = False
        self.latest = dict.fromkeys(SERVICES)
        return [Connect(self.session, after_hiccup)]

    def _abandon_recovery(self) -> list[HealthAction]:
        actions = self._cancel(Timer.RECOVERY_RETRY)
        if self.attempt:
            actions.append(AbandonRecovery())
        self.attempt = 0
        self.verifying = False
        return actions

    def _end_hiccup(self) -> list[HealthAction]:
        if self.hiccup is None:
            return []
        self.hiccup = None
        return self._cancel(Timer.HICCUP_DEADLINE)

    def _start_recovery(self, *, verify: bool) -> list[HealthAction]:
        self.attempts += 1
        self.attempt = self.attempts
        self.verifying = verify
        actions = self._cancel(Timer.RECOVERY_RETRY)
        if not verify:
            actions += self._publish(RECOVERING_STATE)
        return [*actions, StartRecovery(self.attempt)]

    def _end_session(self) -> list[HealthAction]:
        self.session = None
        self.watching = self.established = False
        return [EndSession()]

    def _outage(self, state: HealthState) -> list[HealthAction]:
        """End the session, close admission with ``state`` and reconnect after ``retry_interval``."""
        return [
            *self._end_session(),
            *self._abandon_recovery(),
            *self._cancel(Timer.INITIAL_STATUS),
            *self._end_hiccup(),
            *self._publish(state),
            *self._arm(Timer.RECONNECT, self.retry_interval),
        ]

    def _fatal(self, error: Exception) -> list[HealthAction]:
        actions = self._publish(HealthState(HealthKind.FAILED, str(error)))
        return [*actions, Fatal(error)]

    # --- transitions --------------------------------------------------------------------------------

    def _on_connected(self, event: Connected) -> list[HealthAction]:
        self.watching = True
        return self._arm(Timer.INITIAL_STATUS, self.connect_attempt_timeout)

    def _on_connect_failed(self, event: ConnectFailed) -> list[HealthAction]:
        self.session = None
        return [
            *self._end_hiccup(),
            *self._publish(HealthState(HealthKind.UNREACHABLE, event.reason)),
            *self._arm(Timer.RECONNECT, self.retry_interval),
        ]

    def _on_status(self, event: StatusReceived) -> list[HealthAction]:
        self.latest[event.service] = event.status
        self.not_serving = CHECK_NOT_SERVING if event.via_check else WATCH_NOT_SERVING
        actions: list[HealthAction] = []
        if not self.established and None not in self.latest.values():
            self.established = True
            actions += self._cancel(Timer.INITIAL_STATUS)
        if event.status != SERVING:
            return [
                *actions,
                *self._end_hiccup(),
                *self._abandon_recovery(),
                *self._publish(HealthState(HealthKind.NOT_SERVING, self.not_serving)),
            ]
        if not self._all_serving() or self.attempt or self.adopting:
            return actions
        if self.hiccup is not None:  # reconnected after a hiccup: is it still the same vLLM?
            return [*actions, *self._end_hiccup(), *self._start_recovery(verify=True)]
        if not self.published.admits:
            return [*actions, *self._start_recovery(verify=False)]
        return actions

    def _on_watch_ended(self, event: WatchEnded) -> list[HealthAction]:
        forgivable = (
            self.published.admits
            and event.cause is not EndCause.HUNG
            and self.hiccup is None
            and Timer.HICCUP_WINDOW not in self.armed
        )
        if forgivable:
            reason = WATCH_ENDED if event.cause is EndCause.ENDED else event.reason
            self.hiccup = reason
            return [
                *self._end_session(),
                *self._abandon_recovery(),
                *self._cancel(Timer.INITIAL_STATUS),
                *self._arm(Timer.HICCUP_DEADLINE, self.hiccup_deadline),
                *self._arm(Timer.HICCUP_WINDOW, self.retry_interval),
                *self._connect(after_hiccup=reason),
            ]
        if event.cause is EndCause.ENDED:
            state = HealthState(HealthKind.NOT_SERVING, WATCH_ENDED)
        else:
            state = HealthState(HealthKind.UNREACHABLE, event.reason)
        return self._outage(state)

    def _on_recovery_done(self, event: RecoveryDone) -> list[HealthAction]:
        if event.attempt != self.attempt:
            return []  # abandoned meanwhile
        verified = self.verifying
        self.attempt = 0
        self.verifying = False
        error = compare_models(self.model, event.model)
        if error is not None:
            return self._fatal(error)
        if verified and event.model.instance_id == self.model.instance_id and event.sources == self.kv_sources:
            return []  # the same vLLM: the hiccup is over
        actions = self._publish(RECOVERING_STATE) if verified else []
        self.adopting = True
        adopt = Adopt(event.model, event.sources, self.model, self.kv_sources)
        self.model, self.kv_sources = event.model, event.sources
        return [*actions, adopt]

    def _on_recovery_failed(self, event: RecoveryFailed) -> list[HealthAction]:
        if event.attempt != self.attempt:
            return []
        self.attempt = 0
        self.verifying = False
        return [*self._publish(event.state), *self._arm(Timer.RECOVERY_RETRY, self.retry_interval)]

    def _on_adopted(self, event: Adopted) -> list[HealthAction]:
        self.adopting = False
        if not (self.watching and self._all_serving()):
            return []  # a status changed meanwhile: its own transition decides
        return self._publish(SERVING_STATE)

    def _on_adoption_failed(self, event: AdoptionFailed) -> list[HealthAction]:
        self.adopting = False
        return self._fatal(event.error)

    def _on_timer(self, event: TimerFired) -> list[HealthAction]:
        if event.timer not in self.armed:
            return []  # cancelled meanwhile
        self.armed.discard(event.timer)
        return _TIMER_HANDLERS[event.timer](self)

    def _initial_status_due(self) -> list[HealthAction]:
        if self.watching and not self.established:
            return self._outage(HealthState(HealthKind.UNREACHABLE, WATCH_TIMED_OUT))
        return []

    def _reconnect_due(self) -> list[HealthAction]:
        return self._connect() if self.session is None else []

    def _recovery_retry_due(self) -> list[HealthAction]:
        if self.watching and not self.attempt and self._all_serving() and not self.published.admits:
            return self._start_recovery(verify=False)
        return []

    def _hiccup_deadline_due(self) -> list[HealthAction]:
        if self.hiccup is None:
            return []
        reason = f"{self.hiccup}; not watching again within {self.hiccup_deadline:g}s"
        self.hiccup = None
        return self._publish(HealthState(HealthKind.UNREACHABLE, reason))

    def _hiccup_window_over(self) -> list[HealthAction]:
        return []  # (only its being armed matters: another hiccup within it is an outage)


_SESSION_EVENTS = (Connected, ConnectFailed, StatusReceived, WatchEnded)
_HANDLERS: Mapping[type, Callable[..., list[HealthAction]]] = {
    Connected: HealthPolicy._on_connected,
    ConnectFailed: HealthPolicy._on_connect_failed,
    StatusReceived: HealthPolicy._on_status,
    WatchEnded: HealthPolicy._on_watch_ended,
    RecoveryDone: HealthPolicy._on_recovery_done,
    RecoveryFailed: HealthPolicy._on_recovery_failed,
    Adopted: HealthPolicy._on_adopted,
    AdoptionFailed: HealthPolicy._on_adoption_failed,
    TimerFired: HealthPolicy._on_timer,
}
_TIMER_HANDLERS: Mapping[Timer, Callable[[HealthPolicy], list[HealthAction]]] = {
    Timer.INITIAL_STATUS: HealthPolicy._initial_status_due,
    Timer.RECONNECT: HealthPolicy._reconnect_due,
    Timer.RECOVERY_RETRY: HealthPolicy._recovery_retry_due,
    Timer.HICCUP_DEADLINE: HealthPolicy._hiccup_deadline_due,
    Timer.HICCUP_WINDOW: HealthPolicy._hiccup_window_over,
}
