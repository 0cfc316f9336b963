"""Configuration objects and the pre-network checks (docs/reference/sidecar.md#configuration, docs/reference/sidecar.md#pre-network-checks). PURE: no I/O, no Trio.

Construction never validates: the checks run in :func:`validate_sidecar_config` / :func:`prepare`, in the
order of docs/reference/sidecar.md#pre-network-checks, so the first problem reported is the one the native sidecar reports. (The CLI adds its own usage
checks, e.g. zero values, before building these objects.)
"""

from __future__ import annotations

import enum
import importlib.util
import math
from collections.abc import Iterable

import attrs

from .endpoint import GrpcEndpoint, parse_grpc_endpoint
from .errors import InvalidArgument, format_duration
from .rl import parse_admin_base_url

__all__ = [
    "DisaggregationMode",
    "SidecarConfig",
    "WorkerOptions",
    "validate_sidecar_config",
    "prepare",
    "dynamo_available",
    "discovery_banner",
    "DYNAMO_EXTRA_MISSING",
    "MAX_DEADLINE_SECONDS",
]

# A Rust `Instant + Duration` must stay inside the monotonic clock's i64 nanoseconds.
MAX_DEADLINE_SECONDS = 2**63 / 1_000_000_000

DYNAMO_EXTRA_MISSING = "the Dynamo upstream requires the optional 'dynamo' extra (ai-dynamo-runtime==1.6.1)"
OTEL_EXTRA_MISSING = "otel requires the optional 'otel' extra (opentelemetry-api)"


class DisaggregationMode(enum.Enum):
    AGG = "agg"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"

    @classmethod
    def parse(cls, value: str | DisaggregationMode) -> DisaggregationMode:
        """``"agg"``/``"aggregated"``/``"prefill"``/``"decode"``/``"encode"`` (case-insensitive)."""
        if isinstance(value, DisaggregationMode):
            return value
        text = str(value).strip().lower()
        if text == "aggregated":
            return cls.AGG
        try:
            return cls(text)
        except ValueError:
            raise InvalidArgument(
                f"invalid disaggregation mode `{value}`; expected one of agg, aggregated, prefill, decode, encode"
            ) from None

    @property
    def is_prefill(self) -> bool:
        return self is DisaggregationMode.PREFILL

    @property
    def is_decode(self) -> bool:
        return self is DisaggregationMode.DECODE


def _disaggregation_mode(value: str | DisaggregationMode) -> DisaggregationMode:
    # a named function: attrs' type-checker plugin does not follow a classmethod as a converter
    return DisaggregationMode.parse(value)


@attrs.frozen(kw_only=True)
class SidecarConfig:
    """vLLM-side configuration (docs/reference/sidecar.md#configuration). Durations are seconds (fractional in the Python API)."""

    grpc_endpoint: str
    disaggregation_mode: DisaggregationMode = attrs.field(
        default=DisaggregationMode.AGG, converter=_disaggregation_mode
    )
    grpc_connections: int = 8
    connect_attempt_timeout: float = 30.0
    retry_interval: float = 1.0
    startup_deadline: float = 1800.0
    health_prober: bool = True
    abort_on_cancel: bool = True
    abort_timeout: float = 30.0
    #: Project addition (gRPC's client keepalive): PING a connection that has calls open but read nothing
    #: for this long; 0 disables. With the timeout, a hung vLLM is detected within 14 s.
    keepalive_time: float = 10.0
    #: ... and lose it (every call on it fails UNAVAILABLE) when nothing is read this long after the PING.
    keepalive_timeout: float = 4.0
    #: Project addition: open an OpenTelemetry span per request that carries a ``traceparent`` and forward
    #: its context to vLLM (docs/reference/sidecar.md#opentelemetry-span); needs the ``otel`` extra.
    otel: bool = False


def _endpoint_types(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, Iterable):
        raise TypeError(f"expected a list or a comma-separated string, got {type(value).__name__}")
    return tuple(str(v).strip().lower() for v in value if str(v).strip())


@attrs.frozen(kw_only=True)
class WorkerOptions:
    """Dynamo-side options (docs/reference/sidecar.md#configuration) plus the CLI's project options (docs/reference/sidecar.md#configuration, docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/worker.md#graceful-shutdown-and-drain)."""

    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    endpoint_types: tuple[str, ...] = attrs.field(default=("chat", "completions"), converter=_endpoint_types)
    custom_jinja_template: str | None = None
    exclude_tools_when_tool_choice_none: bool = True
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    route_to_encoder: bool = False
    enable_rl: bool = False
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    response_plane: str = "tcp"
    event_plane: str | None = None  # None: the runtime's default (zmq)
    #: The RL worker's ``admin_base_url`` (docs/rl.md); validated and normalized like the native sidecar.
    vllm_http_endpoint: str | None = None
    #: The RL worker's ``world_size`` when vLLM's ``ServerInfo`` does not report one (docs/rl.md).
    vllm_rl_world_size: int | None = None
    unserving_grace: float = 5.0
    drain_timeout: float = 30.0
    #: ``None``: from ``DYN_LOG``, else info (docs/observability.md#logs).
    log_level: str | None = None


def validate_sidecar_config(config: SidecarConfig) -> GrpcEndpoint:
    """The ``SidecarConfig`` part of docs/reference/sidecar.md#pre-network-checks (items 1, 5, 6, 7), in order.

    Returns:
        The normalized endpoint.

    Raises:
        InvalidArgument: with the texts (docs/reference/sidecar.md#pre-network-checks).
    """
    if DisaggregationMode.parse(config.disaggregation_mode) is DisaggregationMode.ENCODE:
        raise InvalidArgument("encode mode is not supported by the vLLM sidecar")
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    _check_transport(config)
    _check_otel(config)
    return endpoint


def _check_transport(config: SidecarConfig) -> None:
    connections = config.grpc_connections
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise InvalidArgument("grpc_connections must be at least 1")
    for name in ("connect_attempt_timeout", "retry_interval"):
        value = getattr(config, name)
        if not _is_number(value) or not value > 0:
            raise InvalidArgument(f"{name} must be positive")
    deadline = config.startup_deadline
    if not _is_number(deadline):
        raise InvalidArgument("startup_deadline must be positive")
    if math.isnan(deadline) or deadline > MAX_DEADLINE_SECONDS:
        raise InvalidArgument(
            f"gRPC startup deadline {format_duration(deadline)} exceeds the supported monotonic clock range"
        )
    if not deadline > 0:
        raise InvalidArgument("startup_deadline must be positive")
    if not _is_number(config.abort_timeout) or not config.abort_timeout > 0:
        raise InvalidArgument("abort_timeout must be positive")
    if not _is_number(config.keepalive_time) or not 0 <= config.keepalive_time < math.inf:
        raise InvalidArgument("keepalive_time must be a finite number of seconds, 0 or more")
    if not _is_number(config.keepalive_timeout) or not 0 < config.keepalive_timeout < math.inf:
        raise InvalidArgument("keepalive_timeout must be positive")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_otel(config: SidecarConfig) -> None:
    if config.otel and not otel_available():
        raise InvalidArgument(OTEL_EXTRA_MISSING)


def otel_available() -> bool:
    """Whether the optional ``otel`` extra (``opentelemetry-api``) can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):
        return False


def dynamo_available() -> bool:
    """Whether the optional ``dynamo`` extra (``ai-dynamo-runtime``) can be imported."""
    try:
        return importlib.util.find_spec("dynamo.llm") is not None and (
            importlib.util.find_spec("dynamo.runtime") is not None
        )
    except (ImportError, ValueError):
        return False


def prepare(config: SidecarConfig, worker_options: WorkerOptions, *, dynamo_required: bool) -> GrpcEndpoint:
    """All the pre-network checks (docs/reference/sidecar.md#pre-network-checks, items 1–8), in order, before any socket is opened.

    The ``Discovering vLLM model metadata ...`` line after them is printed by the caller, from
    :func:`discovery_banner`, so this function stays free of I/O.

    Raises:
        InvalidArgument: the first failing check, with its exact text.
    """
    if DisaggregationMode.parse(config.disaggregation_mode) is DisaggregationMode.ENCODE:
        raise InvalidArgument("encode mode is not supported by the vLLM sidecar")
    if worker_options.route_to_encoder:
        raise InvalidArgument("route-to-encoder is not supported by the vLLM sidecar")
    if worker_options.tool_call_parser or worker_options.reasoning_parser:
        raise InvalidArgument(
            "vLLM gRPC does not preserve the request options required by Dynamo tool-call and reasoning parsers"
        )
    if worker_options.vllm_http_endpoint is not None:
        parse_admin_base_url(worker_options.vllm_http_endpoint)
    if worker_options.vllm_rl_world_size is not None and not 1 <= worker_options.vllm_rl_world_size <= 2**32 - 1:
        raise InvalidArgument("`--vllm-rl-world-size` must be between 1 and 4294967295")
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    _check_transport(config)
    _check_otel(config)
    if dynamo_required and not dynamo_available():
        raise InvalidArgument(DYNAMO_EXTRA_MISSING)
    return endpoint


def discovery_banner(endpoint: GrpcEndpoint, startup_deadline: float) -> str:
    """The stderr line printed after the pre-network checks (docs/reference/sidecar.md#pre-network-checks)."""
    return (
        f"Discovering vLLM model metadata from {endpoint.canonical}; "
        f"startup deadline: {format_duration(startup_deadline)}"
    )
