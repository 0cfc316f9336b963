"""The worker's rotation policy: out of Dynamo's rotation while vLLM is not serving
(docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving). PURE: no Trio, no I/O, no clock.

Theory of operation
-------------------

The worker's counterpart of :class:`~trio_sidecar.core.health_policy.HealthPolicy`, built the same way: events in
(every change of the prober's published state, the grace timer, the outcomes of Dynamo calls), actions out
(arm or cancel the grace timer, take the instance out of rotation, restore it, re-create the KV publishers).
Its I/O adapter is ``worker._supervise_health``.

* Any non-``SERVING`` state while serving arms the grace timer (``unserving_grace``); other non-serving
  states keep it running. When it fires: ``TakeOutOfRotation`` (``unregister_endpoint_instance()``).
* ``SERVING`` again cancels the grace and, if the instance was taken out, restores it
  (``register_endpoint_instance()``) unless a pause or sleep of the RL controls holds it out (their resume
  puts it back). A failed unregister leaves the instance in; a failed register is retried on the next
  ``SERVING``.
* Whenever the KV-event sources differ from the ones relayed while serving (after a recovery, or a replaced
  vLLM adopted after a prober hiccup), the publishers are re-created first.
"""

from __future__ import annotations

import attrs

from ..core.health_policy import ArmTimer, CancelTimer, HealthState, Timer, TimerFired
from ..core.routing import KvEventSource

__all__ = [
    "HealthChanged",
    "RotationDone",
    "PublishersReplaced",
    "TakeOutOfRotation",
    "RestoreToRotation",
    "ReplacePublishers",
    "RotationPolicy",
]


@attrs.frozen
class TakeOutOfRotation:
    reason: str
    grace: float


@attrs.frozen
class RestoreToRotation:
    pass


@attrs.frozen
class ReplacePublishers:
    sources: tuple[KvEventSource, ...]


@attrs.frozen
class HealthChanged:
    """The published state changed (to ``state``); what the worker knew at that moment."""

    state: HealthState
    sources: tuple[KvEventSource, ...]
    rl_withdrawn: bool = False


@attrs.frozen
class RotationDone:
    """The outcome of ``TakeOutOfRotation`` (``in_rotation`` False if it succeeded) or ``RestoreToRotation``."""

    in_rotation: bool


@attrs.frozen
class PublishersReplaced:
    sources: tuple[KvEventSource, ...]


RotationEvent = HealthChanged | TimerFired | RotationDone | PublishersReplaced
RotationAction = ArmTimer | CancelTimer | TakeOutOfRotation | RestoreToRotation | ReplacePublishers


class RotationPolicy:
    """Out of rotation after ``grace`` seconds of continuous non-``SERVING``; back on ``SERVING``."""

    def __init__(self, *, grace: float, sources: tuple[KvEventSource, ...]) -> None:
        self.grace = grace
        self.sources = tuple(sources)  # what the KV publishers relay
        self.admits = True
        self.reason = ""
        self.in_rotation = True
        self.grace_armed = False

    def __repr__(self) -> str:
        return f"<RotationPolicy admits={self.admits} in_rotation={self.in_rotation}>"

    def handle(self, event: RotationEvent) -> list[RotationAction]:
        if isinstance(event, HealthChanged):
            return self._on_health(event)
        if isinstance(event, TimerFired):
            if event.timer is not Timer.GRACE or not self.grace_armed:
                return []
            self.grace_armed = False
            return [TakeOutOfRotation(self.reason, self.grace)]
        if isinstance(event, RotationDone):
            self.in_rotation = event.in_rotation
            return []
        self.sources = event.sources
        return []

    def _on_health(self, event: HealthChanged) -> list[RotationAction]:
        self.reason = event.state.reason
        if not event.state.admits:
            if not self.admits:
                return []  # still not serving: the grace runs on
            self.admits = False
            self.grace_armed = True
            return [ArmTimer(Timer.GRACE, self.grace)]
        actions: list[RotationAction] = []
        if not self.admits:
            self.admits = True
            if self.grace_armed:
                self.grace_armed = False
                actions.append(CancelTimer(Timer.GRACE))
        if event.sources != self.sources:  # (also without an outage: a replaced vLLM adopted after a hiccup)
            actions.append(ReplacePublishers(event.sources))
        if not self.in_rotation:
            if event.rl_withdrawn:
                self.in_rotation = True  # paused or asleep through the RL controls: their resume puts it back
            else:
                actions.append(RestoreToRotation())
        return actions
