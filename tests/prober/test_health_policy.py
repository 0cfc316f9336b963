"""The pure health policies as tables (the prober's ``HealthPolicy``, the worker's ``RotationPolicy``): events
in, actions out; no Trio, no sockets, no clock.

Each row starts the policy in a named situation (reached by feeding it the events of a normal run), feeds
one more event and states the exact actions and the published state that follow. The rotation policy of the
worker is tabled the same way.
"""

from __future__ import annotations

import attrs
import pytest
from prober_fakes import model_info, server_info

from trio_sidecar.core.errors import ProtocolError
from trio_sidecar.core.health_policy import (
    RECOVERING_STATE,
    SERVING_STATE,
    WATCH_ENDED,
    WATCH_NOT_SERVING,
    WATCH_TIMED_OUT,
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
    hung_engine_deadline,
)
from trio_sidecar.core.model import DiscoveredModel
from trio_sidecar.core.routing import KvEventSource
from trio_sidecar.dynamo.rotation import (
    HealthChanged,
    PublishersReplaced,
    ReplacePublishers,
    RestoreToRotation,
    RotationDone,
    RotationPolicy,
    TakeOutOfRotation,
)

SERVING, NOT_SERVING = 1, 2
CONTROL, INFERENCE = "vllm.Control", "vllm.Inference"
ATTEMPT, RETRY, HICCUP = 30.0, 1.0, 14.0
FAILED_WATCH = "vllm.Control Health.Watch failed: connection reset (Unavailable)"
HUNG_WATCH = (
    "vllm.Control Health.Watch failed: connection lost: keepalive PING not acknowledged within 4s (Unavailable)"
)
CANNOT_CONNECT = "cannot connect to http://127.0.0.1:1: Connection refused"
SOURCES = (KvEventSource("tcp://127.0.0.1:20080", "", 0),)


def model(*, instance_id: str = "instance-1", name: str = "served-model", dp_size: int = 1) -> DiscoveredModel:
    return DiscoveredModel.from_proto(
        model_info(served_model_name=name), server_info(instance_id=instance_id, dp_size=dp_size)
    )


def unreachable(reason: str) -> HealthState:
    return HealthState(HealthKind.UNREACHABLE, reason)


NOT_SERVING_STATE = HealthState(HealthKind.NOT_SERVING, WATCH_NOT_SERVING)


def policy() -> HealthPolicy:
    return HealthPolicy(
        model=model(), kv_sources=SOURCES, connect_attempt_timeout=ATTEMPT, retry_interval=RETRY, hiccup_deadline=HICCUP
    )


def both(session: int, status: int = SERVING) -> list:
    return [StatusReceived(session, CONTROL, status), StatusReceived(session, INFERENCE, status)]


# Situations: the events that lead to them, from a freshly started policy (``start()`` already called).
SITUATIONS: dict[str, list] = {
    "connecting": [],
    "watching": [Connected(1)],
    "serving": [Connected(1), *both(1)],
    "not serving": [Connected(1), *both(1), StatusReceived(1, INFERENCE, NOT_SERVING)],
    "recovering": [Connected(1), *both(1), *both(1, NOT_SERVING), *both(1)],
    "recovery failed": [
        Connected(1),
        *both(1),
        *both(1, NOT_SERVING),
        *both(1),
        RecoveryFailed(1, unreachable("GetModelInfo: warming up (Unavailable)")),
    ],
    "adopting": [Connected(1), *both(1), *both(1, NOT_SERVING), *both(1), RecoveryDone(1, model(), SOURCES)],
    "outage": [Connected(1), *both(1), WatchEnded(1, EndCause.HUNG, HUNG_WATCH)],
    "hiccup": [Connected(1), *both(1), WatchEnded(1, EndCause.FAILED, FAILED_WATCH)],
    "hiccup watching": [Connected(1), *both(1), WatchEnded(1, EndCause.FAILED, FAILED_WATCH), Connected(2)],
    "verifying": [Connected(1), *both(1), WatchEnded(1, EndCause.FAILED, FAILED_WATCH), Connected(2), *both(2)],
    "verified": [
        Connected(1),
        *both(1),
        WatchEnded(1, EndCause.FAILED, FAILED_WATCH),
        Connected(2),
        *both(2),
        RecoveryDone(1, model(), SOURCES),
    ],
}


def situated(name: str) -> HealthPolicy:
    machine = policy()
    machine.start()
    for event in SITUATIONS[name]:
        machine.handle(event)
    return machine


@attrs.frozen
class Row:
    situation: str
    event: object
    actions: list
    published: HealthState


ROWS = {
    # --- a session starts -------------------------------------------------------------------------
    "connected arms the first-status deadline": Row(
        "connecting", Connected(1), [ArmTimer(Timer.INITIAL_STATUS, ATTEMPT)], SERVING_STATE
    ),
    "a failed connect closes admission and reconnects later": Row(
        "connecting",
        ConnectFailed(1, CANNOT_CONNECT),
        [Publish(unreachable(CANNOT_CONNECT), warn=True), ArmTimer(Timer.RECONNECT, RETRY)],
        unreachable(CANNOT_CONNECT),
    ),
    "one first status is not yet established": Row("watching", StatusReceived(1, CONTROL, SERVING), [], SERVING_STATE),
    "no first status in time is unreachable": Row(
        "watching",
        TimerFired(Timer.INITIAL_STATUS),
        [EndSession(), Publish(unreachable(WATCH_TIMED_OUT), warn=True), ArmTimer(Timer.RECONNECT, RETRY)],
        unreachable(WATCH_TIMED_OUT),
    ),
    "the reconnect timer starts the next session": Row(
        "outage", TimerFired(Timer.RECONNECT), [Connect(2)], unreachable(HUNG_WATCH)
    ),
    "an event of an ended session is ignored": Row(
        "hiccup watching", StatusReceived(1, CONTROL, NOT_SERVING), [], SERVING_STATE
    ),
    # --- statuses -----------------------------------------------------------------------------------
    "serving stays serving without a recovery": Row("serving", StatusReceived(1, CONTROL, SERVING), [], SERVING_STATE),
    "a status other than serving closes admission with a warning": Row(
        "serving",
        StatusReceived(1, INFERENCE, NOT_SERVING),
        [Publish(NOT_SERVING_STATE, warn=True)],
        NOT_SERVING_STATE,
    ),
    "the Check fallback names Check": Row(
        "serving",
        StatusReceived(1, CONTROL, NOT_SERVING, via_check=True),
        [Publish(HealthState(HealthKind.NOT_SERVING, "vLLM Health.Check is not SERVING"), warn=True)],
        HealthState(HealthKind.NOT_SERVING, "vLLM Health.Check is not SERVING"),
    ),
    "still not serving publishes nothing new": Row(
        "not serving", StatusReceived(1, CONTROL, NOT_SERVING), [], NOT_SERVING_STATE
    ),
    "one service back is not yet a recovery": Row(
        "not serving", StatusReceived(1, CONTROL, SERVING), [], NOT_SERVING_STATE
    ),
    "both services back start a recovery": Row(
        "not serving",
        StatusReceived(1, INFERENCE, SERVING),
        [Publish(RECOVERING_STATE), StartRecovery(1)],
        RECOVERING_STATE,
    ),
    # --- recovery -----------------------------------------------------------------------------------
    "the same model is adopted": Row(
        "recovering",
        RecoveryDone(1, model(instance_id="instance-2"), SOURCES),
        [Adopt(model(instance_id="instance-2"), SOURCES, model(), SOURCES)],
        RECOVERING_STATE,
    ),
    "once adopted, serving": Row("adopting", Adopted(), [Publish(SERVING_STATE)], SERVING_STATE),
    "a stale recovery outcome is ignored": Row("recovering", RecoveryDone(7, model(), SOURCES), [], RECOVERING_STATE),
    "not serving during a recovery abandons it": Row(
        "recovering",
        StatusReceived(1, CONTROL, NOT_SERVING),
        [AbandonRecovery(), Publish(NOT_SERVING_STATE)],  # warned when it first stopped serving
        NOT_SERVING_STATE,
    ),
    "a transient recovery failure closes admission and retries": Row(
        "recovering",
        RecoveryFailed(1, unreachable("GetModelInfo: warming up (Unavailable)")),
        [
            Publish(unreachable("GetModelInfo: warming up (Unavailable)"), warn=True),
            ArmTimer(Timer.RECOVERY_RETRY, RETRY),
        ],
        unreachable("GetModelInfo: warming up (Unavailable)"),
    ),
    "the retry timer starts the next recovery": Row(
        "recovery failed",
        TimerFired(Timer.RECOVERY_RETRY),
        [Publish(RECOVERING_STATE), StartRecovery(2)],
        RECOVERING_STATE,
    ),
    "not serving cancels a pending retry": Row(
        "recovery failed",
        StatusReceived(1, CONTROL, NOT_SERVING),
        [CancelTimer(Timer.RECOVERY_RETRY), Publish(NOT_SERVING_STATE, warn=True)],
        NOT_SERVING_STATE,
    ),
    # --- sessions that end --------------------------------------------------------------------------
    "a watch failing while serving is a hiccup: reconnect at once, admission open": Row(
        "serving",
        WatchEnded(1, EndCause.FAILED, FAILED_WATCH),
        [
            EndSession(),
            ArmTimer(Timer.HICCUP_DEADLINE, HICCUP),
            ArmTimer(Timer.HICCUP_WINDOW, RETRY),
            Connect(2, after_hiccup=FAILED_WATCH),
        ],
        SERVING_STATE,
    ),
    "a watch ending OK while serving is a hiccup too": Row(
        "serving",
        WatchEnded(1, EndCause.ENDED, ""),
        [
            EndSession(),
            ArmTimer(Timer.HICCUP_DEADLINE, HICCUP),
            ArmTimer(Timer.HICCUP_WINDOW, RETRY),
            Connect(2, after_hiccup=WATCH_ENDED),
        ],
        SERVING_STATE,
    ),
    "a connection the keepalive lost is an outage at once": Row(
        "serving",
        WatchEnded(1, EndCause.HUNG, HUNG_WATCH),
        [EndSession(), Publish(unreachable(HUNG_WATCH), warn=True), ArmTimer(Timer.RECONNECT, RETRY)],
        unreachable(HUNG_WATCH),
    ),
    "a watch ending OK while not serving is an outage": Row(
        "not serving",
        WatchEnded(1, EndCause.ENDED, ""),
        [EndSession(), Publish(HealthState(HealthKind.NOT_SERVING, WATCH_ENDED)), ArmTimer(Timer.RECONNECT, RETRY)],
        HealthState(HealthKind.NOT_SERVING, WATCH_ENDED),
    ),
    "a watch failing during a recovery abandons it and is an outage": Row(
        "recovering",
        WatchEnded(1, EndCause.FAILED, FAILED_WATCH),
        [
            EndSession(),
            AbandonRecovery(),
            Publish(unreachable(FAILED_WATCH), warn=True),
            ArmTimer(Timer.RECONNECT, RETRY),
        ],
        unreachable(FAILED_WATCH),
    ),
    # --- after a hiccup -----------------------------------------------------------------------------
    "the reconnect after a hiccup failing closes admission": Row(
        "hiccup",
        ConnectFailed(2, CANNOT_CONNECT),
        [
            CancelTimer(Timer.HICCUP_DEADLINE),
            Publish(unreachable(CANNOT_CONNECT), warn=True),
            ArmTimer(Timer.RECONNECT, RETRY),
        ],
        unreachable(CANNOT_CONNECT),
    ),
    "the reconnect after a hiccup past the hung-engine deadline closes admission": Row(
        "hiccup watching",
        TimerFired(Timer.HICCUP_DEADLINE),
        [Publish(unreachable(f"{FAILED_WATCH}; not watching again within 14s"), warn=True)],
        unreachable(f"{FAILED_WATCH}; not watching again within 14s"),
    ),
    "not serving reported after a hiccup closes admission": Row(
        "hiccup watching",
        StatusReceived(2, CONTROL, NOT_SERVING),
        [CancelTimer(Timer.HICCUP_DEADLINE), Publish(NOT_SERVING_STATE, warn=True)],
        NOT_SERVING_STATE,
    ),
    "both serving after a hiccup start a verification that keeps admission open": Row(
        "hiccup watching",
        [StatusReceived(2, CONTROL, SERVING), StatusReceived(2, INFERENCE, SERVING)],
        [CancelTimer(Timer.INITIAL_STATUS), CancelTimer(Timer.HICCUP_DEADLINE), StartRecovery(1)],
        SERVING_STATE,
    ),
    "the same vLLM after a hiccup ends it without any action": Row(
        "verifying",
        RecoveryDone(1, model(), SOURCES),
        [],
        SERVING_STATE,
    ),
    "a replaced vLLM found by the verification goes through RECOVERING and is adopted": Row(
        "verifying",
        RecoveryDone(1, model(instance_id="instance-2"), ()),
        [Publish(RECOVERING_STATE), Adopt(model(instance_id="instance-2"), (), model(), SOURCES)],
        RECOVERING_STATE,
    ),
    "a failed verification closes admission and retries as a recovery": Row(
        "verifying",
        RecoveryFailed(1, HealthState(HealthKind.NOT_SERVING, "GetModelInfo: no (Internal)")),
        [
            Publish(HealthState(HealthKind.NOT_SERVING, "GetModelInfo: no (Internal)"), warn=True),
            ArmTimer(Timer.RECOVERY_RETRY, RETRY),
        ],
        HealthState(HealthKind.NOT_SERVING, "GetModelInfo: no (Internal)"),
    ),
    "a second hiccup within the retry interval is an outage": Row(
        "verified",
        WatchEnded(2, EndCause.FAILED, FAILED_WATCH),
        [EndSession(), Publish(unreachable(FAILED_WATCH), warn=True), ArmTimer(Timer.RECONNECT, RETRY)],
        unreachable(FAILED_WATCH),
    ),
    "a session ending before the hiccup's reconnect is established is an outage": Row(
        "hiccup watching",
        WatchEnded(2, EndCause.FAILED, FAILED_WATCH),
        [
            EndSession(),
            CancelTimer(Timer.INITIAL_STATUS),
            CancelTimer(Timer.HICCUP_DEADLINE),
            Publish(unreachable(FAILED_WATCH), warn=True),
            ArmTimer(Timer.RECONNECT, RETRY),
        ],
        unreachable(FAILED_WATCH),
    ),
    "a cancelled timer that fires anyway does nothing": Row(
        "verified", TimerFired(Timer.HICCUP_DEADLINE), [], SERVING_STATE
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_health_policy_transition(row: Row) -> None:
    machine = situated(row.situation)
    events = row.event if isinstance(row.event, list) else [row.event]
    actions = [action for event in events for action in machine.handle(event)]
    assert actions == row.actions
    assert machine.published == row.published


def test_start_connects_the_first_session() -> None:
    assert policy().start() == [Connect(1)]


def test_a_hiccup_is_forgiven_again_once_the_window_has_passed() -> None:
    machine = situated("verified")
    assert machine.handle(TimerFired(Timer.HICCUP_WINDOW)) == []
    actions = machine.handle(WatchEnded(2, EndCause.FAILED, FAILED_WATCH))
    assert actions[-1] == Connect(3, after_hiccup=FAILED_WATCH)
    assert machine.published == SERVING_STATE


@pytest.mark.parametrize(
    ("observed", "message"),
    [
        (
            model(name="other-model"),
            "model identity changed after vLLM recovery: expected {expected!r}, observed {observed!r}",
        ),
        (model(dp_size=2), "data-parallel size changed after vLLM recovery: expected 1, observed 2"),
    ],
    ids=["identity", "dp size"],
)
@pytest.mark.parametrize("situation", ["recovering", "verifying"])
def test_a_changed_model_is_fatal(situation: str, observed: DiscoveredModel, message: str) -> None:
    machine = situated(situation)
    publish, fatal = machine.handle(RecoveryDone(1, observed, SOURCES))
    assert isinstance(fatal, Fatal) and isinstance(fatal.error, ProtocolError)
    assert fatal.error.detail == message.format(expected=model().identity, observed=observed.identity)
    assert publish == Publish(HealthState(HealthKind.FAILED, fatal.error.message))
    assert machine.handle(StatusReceived(1, CONTROL, NOT_SERVING)) == []  # FAILED is final
    assert machine.handle(TimerFired(Timer.RECONNECT)) == []


def test_a_failing_adoption_is_fatal() -> None:
    machine = situated("adopting")
    error = RuntimeError("publisher re-creation failed")
    assert machine.handle(AdoptionFailed(error)) == [
        Publish(HealthState(HealthKind.FAILED, "publisher re-creation failed")),
        Fatal(error),
    ]


def test_the_warning_is_given_once_per_kind_until_serving_again() -> None:
    machine = situated("not serving")
    assert machine.handle(WatchEnded(1, EndCause.FAILED, FAILED_WATCH))[1] == Publish(
        unreachable(FAILED_WATCH), warn=True
    )
    assert machine.handle(TimerFired(Timer.RECONNECT)) == [Connect(2)]
    assert machine.handle(ConnectFailed(2, CANNOT_CONNECT))[0] == Publish(unreachable(CANNOT_CONNECT), warn=False)


@pytest.mark.parametrize(
    ("keepalive_time", "keepalive_timeout", "attempt", "deadline"),
    [(10.0, 4.0, 30.0, 14.0), (10.0, 4.0, 5.0, 5.0), (0.0, 4.0, 30.0, 30.0), (1.0, 0.5, 30.0, 1.5)],
)
def test_the_hiccup_deadline_is_the_hung_engine_deadline(keepalive_time, keepalive_timeout, attempt, deadline) -> None:
    assert (
        hung_engine_deadline(
            connect_attempt_timeout=attempt, keepalive_time=keepalive_time, keepalive_timeout=keepalive_timeout
        )
        == deadline
    )


# --- the worker's rotation ---------------------------------------------------------------------------------

GRACE = 5.0
DOWN = HealthChanged(NOT_SERVING_STATE, SOURCES)
UP = HealthChanged(SERVING_STATE, SOURCES)
ROTATION_SITUATIONS: dict[str, list] = {
    "in rotation": [],
    "in grace": [DOWN],
    "out of rotation": [DOWN, TimerFired(Timer.GRACE), RotationDone(in_rotation=False)],
    "unregister failed": [DOWN, TimerFired(Timer.GRACE), RotationDone(in_rotation=True)],
    "register failed": [DOWN, TimerFired(Timer.GRACE), RotationDone(in_rotation=False), UP, RotationDone(False)],
}

ROTATION_ROWS = {
    "not serving arms the grace": ("in rotation", DOWN, [ArmTimer(Timer.GRACE, GRACE)]),
    "another non-serving state keeps the grace running": (
        "in grace",
        HealthChanged(unreachable(CANNOT_CONNECT), SOURCES),
        [],
    ),
    "the grace over takes the instance out": (
        "in grace",
        TimerFired(Timer.GRACE),
        [TakeOutOfRotation(WATCH_NOT_SERVING, GRACE)],
    ),
    "serving within the grace only cancels it": ("in grace", UP, [CancelTimer(Timer.GRACE)]),
    "serving again restores the instance": ("out of rotation", UP, [RestoreToRotation()]),
    "changed KV-event sources re-create the publishers first": (
        "out of rotation",
        HealthChanged(SERVING_STATE, ()),
        [ReplacePublishers(()), RestoreToRotation()],
    ),
    "changed sources after a short outage re-create the publishers": (
        "in grace",
        HealthChanged(SERVING_STATE, ()),
        [CancelTimer(Timer.GRACE), ReplacePublishers(())],
    ),
    "changed sources while serving re-create the publishers": (
        "in rotation",
        HealthChanged(SERVING_STATE, ()),
        [ReplacePublishers(())],
    ),
    "a failed register is retried on the next serving state": (
        "register failed",
        HealthChanged(SERVING_STATE, SOURCES),
        [RestoreToRotation()],
    ),
    "an instance the RL controls withdrew stays out": (
        "out of rotation",
        HealthChanged(SERVING_STATE, SOURCES, rl_withdrawn=True),
        [],
    ),
    "a failed unregister does not restore": ("unregister failed", UP, []),
    "a recovering state is not serving either": (
        "in rotation",
        HealthChanged(RECOVERING_STATE, SOURCES),
        [ArmTimer(Timer.GRACE, GRACE)],
    ),
}


@pytest.mark.parametrize(("situation", "event", "actions"), ROTATION_ROWS.values(), ids=ROTATION_ROWS.keys())
def test_rotation_policy_transition(situation: str, event: object, actions: list) -> None:
    machine = RotationPolicy(grace=GRACE, sources=SOURCES)
    for earlier in ROTATION_SITUATIONS[situation]:
        machine.handle(earlier)
    assert machine.handle(event) == actions


def test_rotation_takes_out_with_the_latest_reason_and_tracks_replaced_publishers() -> None:
    machine = RotationPolicy(grace=GRACE, sources=SOURCES)
    machine.handle(DOWN)
    machine.handle(HealthChanged(unreachable(CANNOT_CONNECT), SOURCES))
    assert machine.handle(TimerFired(Timer.GRACE)) == [TakeOutOfRotation(CANNOT_CONNECT, GRACE)]
    assert machine.handle(TimerFired(Timer.GRACE)) == []  # fires once
    machine.handle(RotationDone(in_rotation=False))
    assert machine.handle(HealthChanged(SERVING_STATE, ())) == [ReplacePublishers(()), RestoreToRotation()]
    machine.handle(PublishersReplaced(()))
    machine.handle(RotationDone(in_rotation=True))
    machine.handle(DOWN)
    assert machine.handle(HealthChanged(SERVING_STATE, ())) == [CancelTimer(Timer.GRACE)]
