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
from .rl_requests import parse_admin_base_url

__all__ = [
    "DisaggregationMode",
    "ENDPOINT_TYPES",
    "KeepaliveConfig",
    "SidecarConfig",
    "WorkerOptions",
    "validate_sidecar_config",
    "prepare",
    "dynamo_available",
    "discovery_banner",
    "model_type_names",
    "DYNAMO_EXTRA_MISSING",
    "MAX_DEADLINE_SECONDS",
    "keepalive_config",
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


def _seconds(what: str, *, optional: bool = False):  # type: ignore[no-untyped-def]
    """An attrs validator: a finite, positive number of seconds (or None when ``optional``)."""

    def check(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
        if value is None and optional:
            return
        if not _is_number(value) or not 0 < value < math.inf:  # type: ignore[operator]
            raise ValueError(f"{what} must be a finite, positive number of seconds")

    return check


def _strikes(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError("max_ping_strikes must be a whole number, 0 or more, or None")


@attrs.frozen(kw_only=True)
class KeepaliveConfig:
    """HTTP/2 keepalive and PING policy as gRPC defines them (gRFC A8, gRPC-core's channel arguments).

    One type for both ends of a connection, with each end's defaults: :meth:`client` (gRPC's client:
    keepalive off) and :meth:`server` (gRPC-core's server policy). Durations are seconds. Construction
    validates every field (``ValueError``).

    Client (``connect_channel``): while a connection has calls open and read nothing for ``time``, it
    sends a PING, and loses the connection (every call fails UNAVAILABLE) when nothing is read within
    ``timeout`` after it. It never PINGs more often than a server enforcing ``min_ping_interval_without_data``
    permits: a PING is sent only if the server sent HEADERS, DATA or WINDOW_UPDATE since the
    acknowledgement of the previous PING (gRPC-core's server then does not count it) or once
    ``min_ping_interval_without_data`` has passed since that acknowledgement. A connection without calls
    is never PINGed (gRPC's ``keepalive_permit_without_calls`` off).

    Server (``serve_grpc``, ``ServerLimits.keepalive``): gRPC-core's ping policing. A PING that arrives
    sooner than ``min_ping_interval_without_data`` after the previous one, with no HEADERS, DATA or
    WINDOW_UPDATE sent in between, is a strike (on a connection without calls the interval is 2 hours);
    past ``max_ping_strikes`` strikes the server sends GOAWAY ENHANCE_YOUR_CALM with debug data
    ``too_many_pings`` and closes the connection. ``max_ping_strikes=None`` polices nothing.
    """

    #: ``GRPC_ARG_KEEPALIVE_TIME_MS``; None: no keepalive PINGs (the client's default, as in gRPC).
    time: float | None = attrs.field(default=None, validator=_seconds("keepalive time", optional=True))
    #: ``GRPC_ARG_KEEPALIVE_TIMEOUT_MS`` (gRPC's default: 20 s).
    timeout: float = attrs.field(default=20.0, validator=_seconds("keepalive timeout"))
    #: ``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS`` (gRPC-core's default: 5 minutes): enforced by
    #: a server, respected by a client (which cannot know the server's value and assumes gRPC-core's).
    min_ping_interval_without_data: float = attrs.field(
        default=300.0, validator=_seconds("min_ping_interval_without_data")
    )
    #: ``GRPC_ARG_HTTP2_MAX_PING_STRIKES`` (gRPC-core's server default: 2); None: no policing (a client's value).
    max_ping_strikes: int | None = attrs.field(default=None, validator=_strikes)

    @classmethod
    def client(cls, **overrides: float | None) -> KeepaliveConfig:
        """gRPC's client defaults (keepalive off, 20 s timeout, a gRPC-core peer assumed), then ``overrides``."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def server(cls, **overrides: float | int | None) -> KeepaliveConfig:
        """gRPC-core's server policy (5 minutes between PINGs without data, 2 strikes), then ``overrides``."""
        values: dict[str, float | int | None] = {"max_ping_strikes": 2, **overrides}
        return cls(**values)  # type: ignore[arg-type]


def keepalive_config(config: SidecarConfig) -> KeepaliveConfig:
    """The client keepalive of every vLLM connection: ``keepalive_time`` (0: off) and ``keepalive_timeout``.

    Raises:
        InvalidArgument: the texts of docs/reference/sidecar.md#pre-network-checks.
    """
    if not _is_number(config.keepalive_time) or not 0 <= config.keepalive_time < math.inf:
        raise InvalidArgument("keepalive_time must be a finite number of seconds, 0 or more")
    if not _is_number(config.keepalive_timeout) or not 0 < config.keepalive_timeout < math.inf:
        raise InvalidArgument("keepalive_timeout must be positive")
    gap = config.keepalive_min_ping_interval
    if not _is_number(gap) or not 0 < gap < math.inf:
        raise InvalidArgument("keepalive_min_ping_interval must be positive")
    return KeepaliveConfig.client(
        time=config.keepalive_time or None, timeout=config.keepalive_timeout, min_ping_interval_without_data=gap
    )


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
    #: Project addition (gRPC's client keepalive, :class:`KeepaliveConfig`): PING a connection that has calls
    #: open but read nothing for this long; 0 disables. With the timeout, a hung vLLM is detected within 14 s
    #: on a connection whose server sent data since its previous PING (a stream in progress); otherwise PINGs
    #: are at least 5 minutes apart (gRPC-core's server policy).
    keepalive_time: float = 10.0
    #: ... and lose it (every call on it fails UNAVAILABLE) when nothing is read this long after the PING.
    keepalive_timeout: float = 4.0
    #: ... but never sooner than this after the previous PING's acknowledgement, unless vLLM sent data since
    #: (:attr:`KeepaliveConfig.min_ping_interval_without_data`: gRPC-core's server default, 5 minutes).
    keepalive_min_ping_interval: float = 300.0
    #: Project addition: open an OpenTelemetry span per request that carries a ``traceparent`` and forward
    #: its context to vLLM (docs/reference/sidecar.md#opentelemetry-span); needs the ``otel`` extra.
    otel: bool = False


#: ``--endpoint-types`` names -> ``dynamo.llm.ModelType`` member names. Native 1.6.1 accepts exactly these
#: (case-insensitive, singular or plural), skips empty items and merges repeats; anything else fails its
#: registration with ``unknown endpoint type '{name}'``.
ENDPOINT_TYPES = {
    "chat": "Chat",
    "completions": "Completions",
    "embedding": "Embedding",
    "embeddings": "Embedding",
    "image": "Images",
    "images": "Images",
    "audio": "Audios",
    "audios": "Audios",
    "video": "Videos",
    "videos": "Videos",
    "tensor": "TensorBased",
}
_ENDPOINT_TYPE_CHOICES = "chat, completions, embeddings, images, audios, videos, tensor"


def _endpoint_types(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, Iterable):
        raise TypeError(f"expected a list or a comma-separated string, got {type(value).__name__}")
    return tuple(str(v).strip().lower() for v in value if str(v).strip())


def model_type_names(endpoint_types: Iterable[str]) -> tuple[str, ...]:
    """The ``dynamo.llm.ModelType`` member names of normalized endpoint types, without repeats, in order.

    Raises:
        InvalidArgument: ``unknown endpoint type '{name}'`` or ``endpoint_types cannot be empty`` (native's
            texts; native reports them after discovery, trio-sidecar before any socket is opened).
    """
    names = []
    for kind in endpoint_types:
        if kind not in ENDPOINT_TYPES:
            raise InvalidArgument(f"unknown endpoint type '{kind}'; expected some of {_ENDPOINT_TYPE_CHOICES}")
        names.append(ENDPOINT_TYPES[kind])
    if not names:
        raise InvalidArgument("endpoint_types cannot be empty")
    return tuple(dict.fromkeys(names))


@attrs.frozen(kw_only=True)
class WorkerOptions:
    """Dynamo-side options (docs/reference/sidecar.md#configuration) plus the CLI's project options (docs/reference/sidecar.md#configuration, docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/worker.md#graceful-shutdown-and-drain)."""

    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    endpoint_types: tuple[str, ...] = attrs.field(default=("chat", "completions"), converter=_endpoint_types)
    custom_jinja_template: str | None = None
    exclude_tools_when_tool_choice_none: bool = True
    #: Dynamo frontend parsers registered in ``runtime_config`` as given (an empty name included, as native
    #: does); ``None``: unset. Control's own parser names are never used.
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
    """The ``SidecarConfig`` part of docs/reference/sidecar.md#pre-network-checks (items 3, 4, 5), in order.

    Returns:
        The normalized endpoint.

    Raises:
        InvalidArgument: with the texts (docs/reference/sidecar.md#pre-network-checks).
    """
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
    keepalive_config(config)


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
    """All the pre-network checks (docs/reference/sidecar.md#pre-network-checks, items 1–6), in order, before any socket is opened.

    The ``Discovering vLLM model metadata ...`` line after them is printed by the caller, from
    :func:`discovery_banner`, so this function stays free of I/O.

    Raises:
        InvalidArgument: the first failing check, with its exact text.
    """
    if DisaggregationMode.parse(config.disaggregation_mode) not in (
        DisaggregationMode.PREFILL,
        DisaggregationMode.ENCODE,
    ):
        model_type_names(worker_options.endpoint_types)  # prefill and encode register none of them (as native)
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
