"""RL requests, the pure half of the RL controls (docs/rl.md): the engine routes a worker serves, the parsing
and validation of their JSON bodies, their JSON answers, and the ``rl`` request-plane endpoint's answers. No
I/O, no Trio (the Control calls are :mod:`trio_sidecar.shell.rl_controls`).

The texts are the native 1.6.1 sidecar's, as observed (docs/dynamo.md#rl-controls). A body that fails here
makes no Control call.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs

from .errors import InvalidArgument, ProtocolError

__all__ = [
    "CONTROL_BODY_NOT_OBJECT",
    "LORA_ROUTES",
    "UPDATE_BODY_NOT_OBJECT",
    "PauseMode",
    "PauseRequest",
    "RlCapabilities",
    "SleepRequest",
    "engine_routes",
    "parse_admin_base_url",
    "parse_finish_weight_update",
    "parse_init_weight_transfer",
    "parse_model_taints",
    "parse_pause",
    "parse_sleep",
    "parse_update_weight_version",
    "parse_update_weights",
    "parse_wake_up",
    "rl_dispatch",
    "rl_endpoint_name",
    "rl_world_size",
    "system_port_required",
    "routes_answer",
    "wake_state_answer",
]

CONTROL_BODY_NOT_OBJECT = "engine control request body must be a JSON object"
UPDATE_BODY_NOT_OBJECT = "engine update request body must be a JSON object"
SYSTEM_PORT_REQUIRED = "RL discovery requires the Dynamo system server; set DYN_SYSTEM_PORT to 0 or a positive port"
RL_ENDPOINT_PREFIX = "RL endpoint configuration: "
DEFAULT_RL_ENDPOINT = "rl"
TOPOLOGY_TAINT_PREFIX = "dynamo.topology/"
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")
_UINT32_MAX = 2**32 - 1

# Always served (the control routes even without --enable-rl; the two updates need no capability).
_BASE_ROUTES = (
    "control/get_weight_version",
    "control/is_paused",
    "control/is_sleeping",
    "control/pause_generation",
    "control/resume_generation",
    "update/model_taints",
    "update/update_weight_version",
)
_SLEEP_ROUTES = ("control/sleep", "control/wake_up")
_WEIGHT_TRANSFER_ROUTES = (
    "update/finish_weight_update",
    "update/init_weight_transfer_engine",
    "update/start_weight_update",
    "update/update_weights",
)
_DRAFT_ROUTES = ("update/start_draft_weight_update",)
#: Registered by the LoRA surface when LoRA is enabled; listed by the ``rl`` endpoint with the others.
LORA_ROUTES = ("update/list_loras", "update/load_lora", "update/unload_lora")


class PauseMode(enum.Enum):
    """A pause mode; ``proto`` is its ``vllm.PauseMode`` name."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"

    @property
    def proto(self) -> str:
        """The ``vllm.PauseMode`` value's name (``PAUSE_MODE_ABORT`` …)."""
        return f"PAUSE_MODE_{self.name}"


@attrs.frozen(kw_only=True)
class RlCapabilities:
    """``ServerInfo.rl_capabilities``: what the engine allows beyond pause/resume and the weight version."""

    sleep_mode: bool = False
    weight_transfer: bool = False
    draft_weight_updates: bool = False

    @classmethod
    def from_server_info(cls, server_info: Any) -> RlCapabilities:
        """From a ``vllm.ServerInfo`` message (absent capabilities: none)."""
        if not server_info.HasField("rl_capabilities"):
            return cls()
        caps = server_info.rl_capabilities
        return cls(
            sleep_mode=caps.sleep_mode_enabled,
            weight_transfer=caps.weight_transfer_enabled or bool(caps.weight_transfer_backend),
            draft_weight_updates=caps.draft_weight_updates_enabled,
        )


def engine_routes(capabilities: RlCapabilities, *, lora: bool) -> tuple[str, ...]:
    """Every ``/engine/{route}`` the worker serves, sorted (the ``rl`` endpoint's ``routes``).

    ``lora``: whether the LoRA surface is on (``DYN_LORA_ENABLED`` and a server with ``max_loras`` > 0); its three
    update routes are registered by the LoRA surface, not here, but listed with the others.
    """
    routes = list(_BASE_ROUTES)
    if capabilities.sleep_mode:
        routes += _SLEEP_ROUTES
    if capabilities.weight_transfer:
        routes += _WEIGHT_TRANSFER_ROUTES
        if capabilities.draft_weight_updates:
            routes += _DRAFT_ROUTES
    if lora:
        routes += LORA_ROUTES
    return tuple(sorted(routes))


# --- errors ---------------------------------------------------------------------------------------------------

# --- request bodies ---------------------------------------------------------------------------------------------


def _mode(body: Mapping[str, Any], route: str) -> PauseMode:
    value = body.get("mode")
    if value is None:
        return PauseMode.ABORT
    if not isinstance(value, str):
        raise InvalidArgument("`mode` must be a string")
    try:
        return PauseMode(value)
    except ValueError:
        raise InvalidArgument(f"{route} mode must be abort, wait, or keep; got `{value}`") from None


@attrs.frozen
class PauseRequest:
    mode: PauseMode = PauseMode.ABORT
    clear_cache: bool | None = None


def parse_pause(body: Mapping[str, Any]) -> PauseRequest:
    """``control/pause_generation``: ``mode`` (default abort) and an optional boolean ``clear_cache``."""
    mode = _mode(body, "pause_generation")
    clear_cache = body.get("clear_cache")
    if clear_cache is not None and not isinstance(clear_cache, bool):
        raise InvalidArgument("`clear_cache` must be a boolean")
    return PauseRequest(mode, clear_cache)


@attrs.frozen
class SleepRequest:
    level: int | None = None  # None: vLLM's default (1)
    mode: PauseMode = PauseMode.ABORT


def parse_sleep(body: Mapping[str, Any]) -> SleepRequest:
    """``control/sleep``: an optional ``level`` 0–2 and a pause ``mode``."""
    level = body.get("level")
    if level is not None:
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _UINT32_MAX:
            raise InvalidArgument("`level` must be a uint32")
        if level > 2:
            raise InvalidArgument("`level` must be one of 0, 1, or 2")
    return SleepRequest(level, _mode(body, "sleep"))


def parse_wake_up(body: Mapping[str, Any]) -> tuple[str, ...]:
    """``control/wake_up``: the ``tags`` to wake (none: everything)."""
    tags = body.get("tags")
    if tags is None:
        return ()
    if not isinstance(tags, list):
        raise InvalidArgument("`tags` must be an array of strings")
    if not all(isinstance(tag, str) for tag in tags):
        raise InvalidArgument("`tags` must contain only strings")
    for tag in tags:
        if tag not in WAKE_UP_TAGS:
            raise InvalidArgument(f"wake_up tag must be weights, kv_cache, or scheduling; got `{tag}`")
    return tuple(tags)


def _compact_json_object(body: Mapping[str, Any], field: str) -> bytes:
    value = body.get(field)
    if not isinstance(value, dict):
        raise InvalidArgument(f"missing `{field}` JSON object")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def parse_init_weight_transfer(body: Mapping[str, Any]) -> bytes:
    """``update/init_weight_transfer_engine``: ``init_info`` as compact JSON (key order kept)."""
    return _compact_json_object(body, "init_info")


def parse_update_weights(body: Mapping[str, Any]) -> bytes:
    """``update/update_weights``: ``update_info`` as compact JSON (key order kept)."""
    return _compact_json_object(body, "update_info")


def parse_finish_weight_update(body: Mapping[str, Any]) -> str | None:
    """``update/finish_weight_update``: an optional ``weight_version`` (``""`` is passed on to vLLM)."""
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise InvalidArgument("`weight_version` must be a string")
    return version


def parse_update_weight_version(body: Mapping[str, Any]) -> str:
    """``update/update_weight_version``: a non-empty ``new_version``."""
    version = body.get("new_version")
    if version is not None and not isinstance(version, str):
        raise InvalidArgument("`new_version` must be a string")
    if not version:
        raise InvalidArgument("missing non-empty `new_version` string")
    return version


def parse_model_taints(body: Mapping[str, Any]) -> tuple[str, ...]:
    """``update/model_taints``: the taints, unique and sorted.

    Raises:
        ValueError: Dynamo's own texts (its ``dynamo.common.model_taints`` helper), answered without a kind.
    """
    taints = body.get("taints")
    if not isinstance(taints, list) or not all(isinstance(taint, str) for taint in taints):
        raise ValueError("'taints' must be a JSON array of strings")
    for taint in taints:
        if taint.startswith(TOPOLOGY_TAINT_PREFIX):
            raise ValueError(f"taint '{taint}' uses reserved prefix '{TOPOLOGY_TAINT_PREFIX}'")
    return tuple(sorted(set(taints)))


# --- answers ------------------------------------------------------------------------------------------------------


def wake_state_answer(status: str, sleeping: bool | None) -> dict[str, Any]:
    """After ``resume_generation`` / ``wake_up``: ``{"status": …}`` plus ``"is_sleeping": true`` while still asleep."""
    return {"status": status, "is_sleeping": True} if sleeping else {"status": status}


def routes_answer(
    routes: Sequence[str], system_url: str | None, world_size: int | None, admin_base_url: str | None
) -> dict[str, Any]:
    """The ``rl`` endpoint's answer to ``{"method": "routes"}``."""
    answer: dict[str, Any] = {"status": "ok", "routes": list(routes)}
    if system_url:
        answer["system_url"] = system_url
    if world_size is not None:
        answer["world_size"] = world_size
    if admin_base_url is not None:
        answer["admin_base_url"] = admin_base_url
    return answer


def rl_dispatch(request: object, describe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The ``rl`` request-plane endpoint: only ``{"method": "routes"}`` is served; it makes no Control call."""
    method = request.get("method") if isinstance(request, dict) else None
    if not isinstance(method, str):
        return {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}
    if method != "routes":
        return {
            "status": "error",
            "method": method,
            "message": "rl request-plane endpoint only supports method='routes'",
        }
    return describe()


# --- configuration ------------------------------------------------------------------------------------------------

_ENDPOINT_NAME = re.compile(r"[A-Za-z0-9_-]+")


def rl_endpoint_name(environ: Mapping[str, str]) -> str:
    """The ``rl`` endpoint's name: ``DYN_RL_ENDPOINT`` (default ``rl``).

    Raises:
        InvalidArgument: ``RL endpoint configuration: DYN_RL_ENDPOINT must …``.
    """
    name = environ.get("DYN_RL_ENDPOINT")
    if name is None:
        return DEFAULT_RL_ENDPOINT
    name = name.strip()
    if not name:
        raise InvalidArgument(RL_ENDPOINT_PREFIX + "DYN_RL_ENDPOINT must not be empty")
    if not _ENDPOINT_NAME.fullmatch(name):
        raise InvalidArgument(RL_ENDPOINT_PREFIX + "DYN_RL_ENDPOINT must contain only letters, digits, '-' or '_'")
    return name


def rl_world_size(server_info: Any, flag: int | None) -> int:
    """The RL worker's ``world_size``, as Dynamo 1.6.1's native sidecar derives it at bootstrap: vLLM's engine
    world size (``ServerInfo.parallelism.world_size``, a multiple of TP × PP) times the DP size; when vLLM
    reports 0, ``--vllm-rl-world-size`` (a multiple of TP × PP × DP), which is then required.

    Raises:
        ProtocolError: missing parallelism or a zero/inconsistent size (native's texts).
        InvalidArgument: the flag is missing or not a multiple of TP × PP × DP.
    """
    if not server_info.HasField("parallelism"):
        raise ProtocolError("RL discovery requires vLLM parallelism metadata")
    par = server_info.parallelism
    for value, name in ((par.tensor_parallel_size, "tensor"), (par.pipeline_parallel_size, "pipeline")):
        if value == 0:
            raise ProtocolError(f"vLLM reports a {name}-parallel size of zero")
    if par.data_parallel_size == 0:
        raise ProtocolError("vLLM reports a data-parallel size of zero")
    minimum = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.world_size >= 2**32:
        raise ProtocolError("vLLM reports an invalid engine world size")
    if par.world_size:
        if par.world_size % minimum:
            raise ProtocolError("vLLM reports an engine world size that is not divisible by TP * PP")
        return int(par.world_size) * int(par.data_parallel_size)
    if flag is None:
        raise InvalidArgument("--vllm-rl-world-size is required when vLLM omits engine world size from gRPC metadata")
    if flag % (minimum * par.data_parallel_size):
        raise InvalidArgument("--vllm-rl-world-size must be divisible by TP * PP * DP")
    return flag


def system_port_required() -> InvalidArgument:
    """``--enable-rl`` without Dynamo's system server (``DYN_SYSTEM_PORT`` unset)."""
    return InvalidArgument(RL_ENDPOINT_PREFIX + SYSTEM_PORT_REQUIRED)


_FLAG = "`--vllm-http-endpoint`"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_admin_base_url(raw: str) -> str:
    """``--vllm-http-endpoint``: the URL published as the RL worker's ``admin_base_url``, normalized like a WHATWG
    URL (lower-case scheme and host, the default port dropped, ``/`` for an empty path).

    Raises:
        InvalidArgument: the native sidecar's texts.
    """
    text = raw.strip()
    if not text:
        raise InvalidArgument(f"{_FLAG} is required and must specify an HTTP server address")
    if "://" not in text:
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", text) and not re.match(r"[0-9.]+:", text):
            raise InvalidArgument(f"{_FLAG} must use HTTP or HTTPS and include a host")
        raise InvalidArgument(f"invalid HTTP endpoint for {_FLAG}: relative URL without a base")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        detail = "invalid IPv6 address" if "IPv6" in str(exc) else "invalid port number"
        raise InvalidArgument(f"invalid HTTP endpoint for {_FLAG}: {detail}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise InvalidArgument(f"{_FLAG} must use HTTP or HTTPS and include a host")
    if not parts.hostname:
        raise InvalidArgument(f"invalid HTTP endpoint for {_FLAG}: empty host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise InvalidArgument(f"{_FLAG} must not include user information")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise InvalidArgument(f"{_FLAG} must not include a query or fragment")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None or port == _DEFAULT_PORTS[scheme] else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path or '/'}"
