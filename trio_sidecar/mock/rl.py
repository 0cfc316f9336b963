"""The mock's RL control state (``Control.PauseGeneration`` … ``GetWeightVersion``, docs/reference/mock.md#rl-controls)
— pure: no I/O, no Trio.

The state machines follow vLLM 0.32's engine core (``vllm/v1/engine/core.py``, ``vllm/v1/executor/abstract.py``):

* pause: ``UNPAUSED`` → ``PAUSED_NEW`` (modes abort and wait) or ``PAUSED_ALL`` (mode keep); any pause
  while paused just changes the state; resume while not paused is a no-op.
* sleep: a sleep first pauses (with the request's mode); level 0 stops there, levels 1 and 2 also put the
  ``weights`` and ``kv_cache`` tags to sleep. ``WakeUp`` with no tags wakes everything; with tags, the
  ``scheduling`` tag is dropped and the rest are woken only if every one of them is asleep (else nothing
  happens, as vLLM only logs a warning). Once no tag is asleep, the scheduler resumes.
  ``IsSleeping`` is ``paused or any tag asleep`` — so a plain ``PauseGeneration`` makes it true, as in vLLM.
* weight version: ``"default"`` until set.

What the server must do to in-flight requests for a pause (abort them, wait for them, or nothing) is
returned as a :class:`PauseMode`; the state changes here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence

import attrs

from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected

__all__ = [
    "SLEEP_MODE_NOT_CONFIGURED",
    "SLEEP_TAGS",
    "WEIGHT_TRANSFER_NOT_CONFIGURED",
    "PauseMode",
    "PauseState",
    "RlCapabilities",
    "RlState",
]

# vLLM 0.32's gRPC texts (observed on the real server, docs/reference/mock.md#rl-controls).
SLEEP_MODE_NOT_CONFIGURED = "sleep mode is not configured; start vLLM with --enable-sleep-mode"
WEIGHT_TRANSFER_NOT_CONFIGURED = "weight transfer is not configured; start vLLM with --weight-transfer-config"
EMPTY_WEIGHT_VERSION = "weight_version must not be empty"
DEFAULT_WEIGHT_VERSION = "default"
SLEEP_TAGS = frozenset({"weights", "kv_cache"})
SCHEDULING_TAG = "scheduling"


class PauseMode(enum.Enum):
    """``vllm.PauseMode``; ``PAUSE_MODE_UNSPECIFIED`` (0) means vLLM's default, abort."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"

    @classmethod
    def from_proto(cls, value: int) -> PauseMode:
        return {0: cls.ABORT, 1: cls.ABORT, 2: cls.WAIT, 3: cls.KEEP}.get(value, cls.ABORT)


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # new requests wait; in-flight ones (mode wait) drain
    PAUSED_ALL = "paused_all"  # nothing is scheduled (mode keep)


@attrs.frozen(kw_only=True)
class RlCapabilities:
    """``ServerInfo.rl_capabilities`` (from the engine arguments)."""

    weight_transfer_backend: str = ""
    sleep_mode_enabled: bool = False
    draft_weight_updates_enabled: bool = False

    @property
    def weight_transfer_enabled(self) -> bool:
        return bool(self.weight_transfer_backend)


def _precondition(message: str) -> RequestRejected:
    return RequestRejected(StatusCode.FAILED_PRECONDITION, message)


def _json_object(data: bytes, field: str) -> dict:
    try:
        value = json.loads(data.decode("utf-8")) if data else None
    except (UnicodeDecodeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise RequestRejected(StatusCode.INVALID_ARGUMENT, f"{field} must be a JSON object")
    return value


class RlState:
    """One server's pause / sleep / weight-update state. Methods raise ``RequestRejected``."""

    def __init__(self, capabilities: RlCapabilities) -> None:
        self.capabilities = capabilities
        self.pause_state = PauseState.UNPAUSED
        self.sleeping_tags: frozenset[str] = frozenset()
        self.sleep_level: int | None = None
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.weight_transfer_initialized = False
        #: ``None``, ``"target"`` or ``"draft"`` between a start and ``FinishWeightUpdate``.
        self.weight_update: str | None = None
        self.weight_update_chunks = 0

    # --- pause ---------------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.pause_state is not PauseState.UNPAUSED

    @property
    def sleeping(self) -> bool:
        return self.paused or bool(self.sleeping_tags)

    def pause(self, mode: PauseMode) -> PauseMode:
        self.pause_state = PauseState.PAUSED_ALL if mode is PauseMode.KEEP else PauseState.PAUSED_NEW
        return mode

    def resume(self) -> None:
        self.pause_state = PauseState.UNPAUSED

    # --- sleep ---------------------------------------------------------------------------------------

    def sleep(self, level: int | None, mode: PauseMode) -> PauseMode:
        if not self.capabilities.sleep_mode_enabled:
            raise _precondition(SLEEP_MODE_NOT_CONFIGURED)
        level = 1 if level is None else level
        if level > 2:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, f"sleep level must be 0, 1 or 2, got {level}")
        self.pause(mode)
        if level >= 1 and "weights" not in self.sleeping_tags:  # vLLM: already asleep -> no change
            self.sleeping_tags = SLEEP_TAGS
            self.sleep_level = level
        return mode

    def wake_up(self, tags: Sequence[str]) -> bool:
        """``WakeUp``: returns whether the engine is fully awake (then it was resumed)."""
        if not self.capabilities.sleep_mode_enabled:
            raise _precondition(SLEEP_MODE_NOT_CONFIGURED)
        wanted = None if not tags else [t for t in tags if t != SCHEDULING_TAG]
        if wanted is None:
            self.sleeping_tags = frozenset()
        elif wanted and self.sleeping_tags and all(t in self.sleeping_tags for t in wanted):
            self.sleeping_tags = self.sleeping_tags - set(wanted)
        if not self.sleeping_tags:
            self.sleep_level = None
            self.resume()
            return True
        return False

    # --- weights -------------------------------------------------------------------------------------

    def _require_weight_transfer(self) -> None:
        if not self.capabilities.weight_transfer_enabled:
            raise _precondition(WEIGHT_TRANSFER_NOT_CONFIGURED)

    def init_weight_transfer(self, init_info_json: bytes) -> None:
        self._require_weight_transfer()
        _json_object(init_info_json, "init_info_json")
        self.weight_transfer_initialized = True

    def start_weight_update(self, *, draft: bool = False) -> None:
        self._require_weight_transfer()
        if draft and not self.capabilities.draft_weight_updates_enabled:
            raise _precondition("draft weight updates are not enabled")
        if not self.weight_transfer_initialized:
            raise _precondition("the weight transfer engine is not initialized")
        if self.weight_update is not None:
            raise _precondition("a weight update is already in progress")
        self.weight_update = "draft" if draft else "target"
        self.weight_update_chunks = 0

    def update_weights(self, update_info_json: bytes) -> None:
        self._require_weight_transfer()
        _json_object(update_info_json, "update_info_json")
        if self.weight_update is None:
            raise _precondition("no weight update is in progress")
        self.weight_update_chunks += 1

    def finish_weight_update(self, weight_version: str | None) -> None:
        self._require_weight_transfer()
        if weight_version is not None and not weight_version:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, EMPTY_WEIGHT_VERSION)
        if self.weight_update is None:
            raise _precondition("no weight update is in progress")
        self.weight_update = None
        if weight_version is not None:
            self.weight_version = weight_version

    def set_weight_version(self, weight_version: str) -> None:
        if not weight_version:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, EMPTY_WEIGHT_VERSION)
        self.weight_version = weight_version
