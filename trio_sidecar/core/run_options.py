"""``trio-sidecar run``'s options: one table (flag, environment variable, default, kind, help) and the
conversion of a raw value by its kind, with the project's messages (docs/reference/sidecar.md#configuration).

PURE: no I/O and no Trio. ``cli.py`` builds the parser from :data:`OPTIONS`, resolves flag > environment >
default, and structures the converted values into ``SidecarConfig`` / ``WorkerOptions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .config import DisaggregationMode

__all__ = ["OPTIONS", "Option", "UsageError", "convert", "parse_bool"]


class UsageError(Exception):
    """A bad command line or environment value (exit 2)."""


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def parse_bool(text: str, source: str) -> bool:
    """``true/false/1/0/yes/no/on/off`` (case-insensitive)."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise UsageError(f"invalid boolean value `{text}` for {source}; expected true/false/1/0/yes/no/on/off")


@attrs.frozen
class Option:
    """One ``run`` option: its flag(s), environment variable, default and converter."""

    flag: str
    env: str | None
    dest: str
    target: str  # "sidecar" | "worker"
    default: Any
    # str | opt_str | url | opt_int | choice | opt_choice | bool_value (takes a value) | switch (flag) |
    # pair (--x/--no-x) | count (integer >= 1) | secs (seconds >= 0) | pos_secs (seconds > 0) | mode |
    # endpoint_types
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    metavar: str | None = None


OPTIONS: tuple[Option, ...] = (
    # vLLM gRPC transport (docs/reference/sidecar.md#configuration)
    Option(
        "--grpc-endpoint",
        "DYN_SIDECAR_GRPC_ENDPOINT",
        "grpc_endpoint",
        "sidecar",
        "",
        "str",
        "vLLM gRPC endpoint (HOST:PORT, http://HOST:PORT or grpc://HOST:PORT); required",
        metavar="URL",
    ),
    Option(
        "--grpc-connections",
        "DYN_SIDECAR_GRPC_CONNECTIONS",
        "grpc_connections",
        "sidecar",
        8,
        "count",
        "number of pooled gRPC connections",
        metavar="N",
    ),
    Option(
        "--grpc-connect-attempt-timeout-secs",
        "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS",
        "connect_attempt_timeout",
        "sidecar",
        30,
        "count",
        "per-attempt connect timeout, in seconds",
        metavar="SECS",
    ),
    Option(
        "--grpc-retry-interval-secs",
        "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS",
        "retry_interval",
        "sidecar",
        1,
        "count",
        "fixed retry interval between connect attempts, in seconds",
        metavar="SECS",
    ),
    Option(
        "--grpc-startup-deadline-secs",
        "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS",
        "startup_deadline",
        "sidecar",
        1800,
        "count",
        "maximum duration of each sidecar gRPC startup phase, in seconds",
        metavar="SECS",
    ),
    # worker registration (docs/reference/sidecar.md#configuration)
    Option(
        "--disaggregation-mode",
        "DYN_DISAGGREGATION_MODE",
        "disaggregation_mode",
        "sidecar",
        "agg",
        "mode",
        "worker role; aggregated is an alias of agg; encode runs a multimodal encoder",
        metavar="MODE",
        choices=("agg", "aggregated", "prefill", "decode", "encode"),
    ),
    Option("--namespace", "DYN_NAMESPACE", "namespace", "worker", "dynamo", "str", "Dynamo namespace"),
    Option(
        "--component",
        "DYN_COMPONENT",
        "component",
        "worker",
        "backend",
        "str",
        "Dynamo component (honoured in aggregated mode only)",
    ),
    Option("--endpoint", "DYN_ENDPOINT", "endpoint", "worker", "generate", "str", "Dynamo endpoint name"),
    Option(
        "--endpoint-types",
        "DYN_ENDPOINT_TYPES",
        "endpoint_types",
        "worker",
        ("chat", "completions"),
        "endpoint_types",
        "comma-separated endpoint types the model is registered for (chat, completions, embeddings, images, "
        "audios, videos, tensor); vLLM gRPC serves chat and completions, other requests get an error",
        metavar="TYPES",
    ),
    Option(
        "--custom-jinja-template",
        "DYN_CUSTOM_JINJA_TEMPLATE",
        "custom_jinja_template",
        "worker",
        None,
        "opt_str",
        "custom chat template path",
        metavar="PATH",
    ),
    Option(
        "--dyn-tool-call-parser",
        "DYN_TOOL_CALL_PARSER",
        "tool_call_parser",
        "worker",
        None,
        "str",
        "Dynamo frontend tool-call parser name for this model (e.g. hermes), registered in the model card",
        metavar="NAME",
    ),
    Option(
        "--dyn-reasoning-parser",
        "DYN_REASONING_PARSER",
        "reasoning_parser",
        "worker",
        None,
        "str",
        "Dynamo frontend reasoning parser name for this model (e.g. deepseek_r1), registered in the model card",
        metavar="NAME",
    ),
    Option(
        "--exclude-tools-when-tool-choice-none",
        "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE",
        "exclude_tools_when_tool_choice_none",
        "worker",
        True,
        "bool_value",
        "passed through to the model card",
        metavar="BOOL",
    ),
    Option(
        "--route-to-encoder",
        "DYN_ROUTE_TO_ENCODER",
        "route_to_encoder",
        "worker",
        False,
        "switch",
        "declare an upstream encode peer (agg and prefill workers only)",
    ),
    Option(
        "--enable-rl",
        "DYN_ENABLE_RL",
        "enable_rl",
        "worker",
        False,
        "switch",
        "publish this worker's engine control/update routes on the RL request-plane endpoint (docs/rl.md)",
    ),
    Option(
        "--vllm-http-endpoint",
        "VLLM_HTTP_ENDPOINT",
        "vllm_http_endpoint",
        "worker",
        None,
        "url",
        "optional controller-routable vLLM HTTP base URL for RL compatibility operations (published as the RL "
        "worker's admin_base_url)",
        metavar="URL",
    ),
    Option(
        "--vllm-rl-world-size",
        "DYN_VLLM_RL_WORLD_SIZE",
        "vllm_rl_world_size",
        "worker",
        None,
        "opt_int",
        "optional total RL process world size for vLLM versions that omit it from gRPC metadata (tensor, "
        "pipeline, prefill-context and data parallelism included)",
        metavar="N",
    ),
    # Dynamo runtime planes (docs/reference/sidecar.md#configuration)
    Option(
        "--discovery-backend",
        "DYN_DISCOVERY_BACKEND",
        "discovery_backend",
        "worker",
        "etcd",
        "choice",
        "discovery backend",
        choices=("kubernetes", "etcd", "file", "mem"),
    ),
    Option(
        "--request-plane",
        "DYN_REQUEST_PLANE",
        "request_plane",
        "worker",
        "tcp",
        "choice",
        "request plane",
        choices=("tcp", "nats"),
    ),
    Option(
        "--response-plane",
        "DYN_RESPONSE_PLANE",
        "response_plane",
        "worker",
        "tcp",
        "choice",
        "response plane (must match the frontend)",
        choices=("tcp", "quic"),
    ),
    Option(
        "--event-plane",
        "DYN_EVENT_PLANE",
        "event_plane",
        "worker",
        None,
        "opt_choice",
        "event plane (unset: the runtime's default, zmq)",
        choices=("nats", "zmq"),
    ),
    # project flags (docs/reference/sidecar.md#configuration)
    Option(
        "--health-prober",
        "TRIO_SIDECAR_HEALTH_PROBER",
        "health_prober",
        "sidecar",
        True,
        "pair",
        "continuous Health.Watch prober",
    ),
    Option(
        "--abort-on-cancel",
        "TRIO_SIDECAR_ABORT_ON_CANCEL",
        "abort_on_cancel",
        "sidecar",
        True,
        "pair",
        "send Control.Abort for abandoned streams",
    ),
    Option(
        "--otel",
        "TRIO_SIDECAR_OTEL",
        "otel",
        "sidecar",
        False,
        "pair",
        "an OpenTelemetry span per traced request, the parent of vLLM's (needs the otel extra and a "
        "configured tracer provider)",
    ),
    Option(
        "--grpc-keepalive-time-secs",
        "TRIO_SIDECAR_GRPC_KEEPALIVE_TIME_SECS",
        "keepalive_time",
        "sidecar",
        10.0,
        "secs",
        "HTTP/2 PING a vLLM connection that has calls open (the health prober's always has) but read "
        "nothing this long, within gRPC-core's ping policy; 0 disables",
        metavar="SECS",
    ),
    Option(
        "--grpc-keepalive-timeout-secs",
        "TRIO_SIDECAR_GRPC_KEEPALIVE_TIMEOUT_SECS",
        "keepalive_timeout",
        "sidecar",
        4.0,
        "pos_secs",
        "close the connection when nothing answers the PING this long; its "
        "requests fail as Unavailable, which Dynamo migrates",
        metavar="SECS",
    ),
    Option(
        "--grpc-keepalive-min-ping-interval-secs",
        "TRIO_SIDECAR_GRPC_KEEPALIVE_MIN_PING_INTERVAL_SECS",
        "keepalive_min_ping_interval",
        "sidecar",
        300.0,
        "pos_secs",
        "never PING a connection sooner than this after the previous PING's acknowledgement unless vLLM sent "
        "data since (gRPC-core servers answer faster PINGs with GOAWAY too_many_pings); lower it only for a "
        "server without a ping policy",
        metavar="SECS",
    ),
    Option(
        "--unserving-grace-secs",
        "TRIO_SIDECAR_UNSERVING_GRACE_SECS",
        "unserving_grace",
        "worker",
        5.0,
        "secs",
        "take the instance out of rotation after vLLM is not serving this long",
        metavar="SECS",
    ),
    Option(
        "--drain-timeout-secs",
        "TRIO_SIDECAR_DRAIN_TIMEOUT_SECS",
        "drain_timeout",
        "worker",
        30.0,
        "secs",
        "graceful-shutdown drain bound",
        metavar="SECS",
    ),
    Option(
        "--log-level",
        "TRIO_SIDECAR_LOG_LEVEL",
        "log_level",
        "worker",
        None,
        "opt_choice",
        "log level of the sidecar's own records; unset: from DYN_LOG, else info",
        choices=("debug", "info", "warning", "error"),
    ),
)


def _decimal(text: str, source: str) -> int:
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in "+-" else stripped
    if not digits.isascii() or not digits.isdigit():
        raise UsageError(f"invalid value `{text}` for {source}: expected a decimal integer")
    return int(stripped)


def _from_env(source: str) -> str:
    return f" (from {source})" if source.startswith("environment") else ""


def _as_bool(opt: Option, text: str, source: str) -> bool:
    return parse_bool(text, source)


def _as_str(opt: Option, text: str, source: str) -> str:
    return text


def _as_opt_str(opt: Option, text: str, source: str) -> str | None:
    return text if text.strip() else None


def _as_count(opt: Option, text: str, source: str) -> int:
    value = _decimal(text, source)
    if value < 1:
        raise UsageError(f"`{opt.flag}` must be at least 1" + _from_env(source))
    return value


def _as_opt_int(opt: Option, text: str, source: str) -> int | None:
    return _as_count(opt, text, source) if text.strip() else None


def _as_secs(opt: Option, text: str, source: str) -> float:
    try:
        seconds = float(text.strip())
    except ValueError:
        raise UsageError(f"invalid value `{text}` for {source}: expected a number of seconds") from None
    if opt.kind == "pos_secs" and not seconds > 0:
        raise UsageError(f"`{opt.flag}` must be a finite, positive number of seconds" + _from_env(source))
    if not seconds >= 0 or seconds == float("inf"):
        raise UsageError(f"`{opt.flag}` must be a finite, non-negative number of seconds" + _from_env(source))
    return seconds


def _as_choice(opt: Option, text: str, source: str) -> str | None:
    lowered = text.strip().lower()
    if opt.kind == "opt_choice" and not lowered:
        return None
    if lowered not in opt.choices:
        raise UsageError(f"invalid value `{text}` for {source}; expected one of {', '.join(opt.choices)}")
    return lowered


def _as_mode(opt: Option, text: str, source: str) -> DisaggregationMode:
    lowered = text.strip().lower()
    if lowered != "aggregated" and lowered not in {m.value for m in DisaggregationMode}:
        raise UsageError(
            f"invalid value `{text}` for {source}; expected one of agg, aggregated, prefill, decode, encode"
        )
    return DisaggregationMode.parse(lowered)


def _as_endpoint_types(opt: Option, text: str, source: str) -> tuple[str, ...]:
    return tuple(text.split(","))  # normalized by WorkerOptions, checked by config.prepare (native's texts)


#: How a raw value of each ``Option.kind`` becomes the config value.
_CONVERTERS: dict[str, Callable[[Option, str, str], Any]] = {
    "switch": _as_bool,
    "pair": _as_bool,
    "bool_value": _as_bool,
    "str": _as_str,
    "url": _as_str,  # kept as given, empty included: checked and normalized by config.prepare
    "opt_str": _as_opt_str,
    "count": _as_count,
    "opt_int": _as_opt_int,
    "secs": _as_secs,
    "pos_secs": _as_secs,
    "choice": _as_choice,
    "opt_choice": _as_choice,
    "mode": _as_mode,
    "endpoint_types": _as_endpoint_types,
}


def convert(opt: Option, raw: Any, source: str) -> Any:
    """``raw`` (a flag's or an environment variable's string; ``True``/``False`` from a switch) as ``opt``'s
    value. ``source`` names where it came from in the messages.

    Raises:
        UsageError: the value does not fit the option's kind.
    """
    if opt.kind in ("switch", "pair") and isinstance(raw, bool):
        return raw
    return _CONVERTERS[opt.kind](opt, str(raw), source)
