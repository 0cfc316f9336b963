"""Configuration objects and the pre-network checks (docs/reference/sidecar.md#configuration, docs/reference/sidecar.md#pre-network-checks)."""

from __future__ import annotations

import math
import socket

import attrs
import pytest

from trio_sidecar.core import config as config_module
from trio_sidecar.core.config import (
    DYNAMO_EXTRA_MISSING,
    DisaggregationMode,
    SidecarConfig,
    WorkerOptions,
    discovery_banner,
    prepare,
    validate_sidecar_config,
)
from trio_sidecar.core.errors import InvalidArgument

UNKNOWN_TYPE = (
    "unknown endpoint type 'rerank'; expected some of chat, completions, embeddings, images, audios, videos, tensor"
)
ADMIN_URL = "`--vllm-http-endpoint` must not include a query or fragment"
ENDPOINT = "`--grpc-endpoint` must include a host"


def test_defaults() -> None:
    cfg = SidecarConfig(grpc_endpoint="127.0.0.1:1")
    assert (cfg.grpc_connections, cfg.connect_attempt_timeout, cfg.retry_interval, cfg.startup_deadline) == (
        8,
        30.0,
        1.0,
        1800.0,
    )
    assert cfg.disaggregation_mode is DisaggregationMode.AGG
    assert cfg.health_prober and cfg.abort_on_cancel and cfg.abort_timeout == 30.0
    assert (cfg.keepalive_time, cfg.keepalive_timeout) == (10.0, 4.0)
    opts = WorkerOptions()
    assert (opts.namespace, opts.component, opts.endpoint) == ("dynamo", "backend", "generate")
    assert opts.endpoint_types == ("chat", "completions")
    assert (opts.unserving_grace, opts.drain_timeout) == (5.0, 30.0)
    assert opts.exclude_tools_when_tool_choice_none is True


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("agg", DisaggregationMode.AGG),
        ("aggregated", DisaggregationMode.AGG),
        ("AGG", DisaggregationMode.AGG),
        ("prefill", DisaggregationMode.PREFILL),
        ("decode", DisaggregationMode.DECODE),
        ("encode", DisaggregationMode.ENCODE),
    ],
)
def test_mode_parse(text: str, mode: DisaggregationMode) -> None:
    assert DisaggregationMode.parse(text) is mode
    assert SidecarConfig(grpc_endpoint="h:1", disaggregation_mode=text).disaggregation_mode is mode


def test_mode_parse_rejects_unknown() -> None:
    with pytest.raises(InvalidArgument, match="invalid disaggregation mode `both`"):
        DisaggregationMode.parse("both")


def _cfg(**kw: object) -> SidecarConfig:
    return SidecarConfig(**{"grpc_endpoint": "127.0.0.1:50051", **kw})  # type: ignore[arg-type]


# Each row breaks every check from its own onwards, so only the order decides the message (docs/reference/sidecar.md#pre-network-checks).
ORDER = [
    (dict(), dict(endpoint_types="chat,rerank", vllm_http_endpoint="http://a?b"), UNKNOWN_TYPE),
    (dict(), dict(endpoint_types=" , ", vllm_http_endpoint="http://a?b"), "endpoint_types cannot be empty"),
    (
        dict(grpc_endpoint="http://", grpc_connections=0),
        dict(enable_rl=True, vllm_http_endpoint="http://a?b"),
        ADMIN_URL,
    ),
    (dict(grpc_endpoint="http://", grpc_connections=0), dict(), ENDPOINT),
]


@pytest.mark.parametrize("mode", ["encode", "agg", "prefill", "decode"])
def test_encoder_settings_pass_the_pre_network_checks(mode: str) -> None:
    # Like native, they are checked once the engine is known (docs/reference/worker.md#encoder-disaggregation).
    prepare(_cfg(disaggregation_mode=mode), WorkerOptions(route_to_encoder=True), dynamo_required=False)
    assert validate_sidecar_config(_cfg(disaggregation_mode=mode)).canonical


@pytest.mark.parametrize(("cfg_kw", "opt_kw", "message"), ORDER)
def test_prepare_checks_in_order(cfg_kw: dict, opt_kw: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        prepare(_cfg(**cfg_kw), WorkerOptions(**opt_kw), dynamo_required=False)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(grpc_connections=0), "grpc_connections must be at least 1"),
        (dict(grpc_connections=-3), "grpc_connections must be at least 1"),
        (dict(connect_attempt_timeout=0), "connect_attempt_timeout must be positive"),
        (dict(connect_attempt_timeout=-1.0), "connect_attempt_timeout must be positive"),
        (dict(connect_attempt_timeout=math.nan), "connect_attempt_timeout must be positive"),
        (dict(retry_interval=0.0), "retry_interval must be positive"),
        (dict(startup_deadline=0), "startup_deadline must be positive"),
        (dict(startup_deadline=-5.0), "startup_deadline must be positive"),
        (dict(startup_deadline=math.inf), "gRPC startup deadline inf exceeds the supported monotonic clock range"),
        (dict(startup_deadline=math.nan), "gRPC startup deadline nan exceeds the supported monotonic clock range"),
        (
            dict(startup_deadline=1e10),
            "gRPC startup deadline 10000000000s exceeds the supported monotonic clock range",
        ),
        (dict(abort_timeout=0), "abort_timeout must be positive"),
        (dict(keepalive_time=-1.0), "keepalive_time must be a finite number of seconds, 0 or more"),
        (dict(keepalive_time=math.inf), "keepalive_time must be a finite number of seconds, 0 or more"),
        (dict(keepalive_time=math.nan), "keepalive_time must be a finite number of seconds, 0 or more"),
        (dict(keepalive_timeout=0), "keepalive_timeout must be positive"),
        (dict(keepalive_timeout=math.inf), "keepalive_timeout must be positive"),
        (dict(keepalive_min_ping_interval=0), "keepalive_min_ping_interval must be positive"),
        (dict(keepalive_min_ping_interval=math.nan), "keepalive_min_ping_interval must be positive"),
    ],
)
def test_transport_values(kw: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_sidecar_config(_cfg(**kw))
    assert str(info.value) == message
    with pytest.raises(InvalidArgument, match=message.split(" ")[0]):
        prepare(_cfg(**kw), WorkerOptions(), dynamo_required=False)


def test_fractional_durations_are_accepted_in_the_api() -> None:
    endpoint = validate_sidecar_config(
        _cfg(connect_attempt_timeout=0.05, retry_interval=0.01, startup_deadline=0.1, grpc_connections=2)
    )
    assert endpoint.canonical == "http://127.0.0.1:50051"


def test_validate_sidecar_config_order() -> None:
    with pytest.raises(InvalidArgument, match="is required"):
        validate_sidecar_config(_cfg(disaggregation_mode="encode", grpc_endpoint="", grpc_connections=0))
    with pytest.raises(InvalidArgument, match="is required"):
        validate_sidecar_config(_cfg(grpc_endpoint="", grpc_connections=0))


def test_missing_dynamo_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "dynamo_available", lambda: False)
    with pytest.raises(InvalidArgument) as info:
        prepare(_cfg(), WorkerOptions(), dynamo_required=True)
    assert str(info.value) == DYNAMO_EXTRA_MISSING
    # Not required (embedded use): no error.
    assert prepare(_cfg(), WorkerOptions(), dynamo_required=False).port == 50051
    # The transport check comes first.
    with pytest.raises(InvalidArgument, match="grpc_connections"):
        prepare(_cfg(grpc_connections=0), WorkerOptions(), dynamo_required=True)


def test_prepare_opens_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)
    for cfg_kw, opt_kw, message in ORDER:
        with pytest.raises(InvalidArgument, match=message[:20]):
            prepare(_cfg(**cfg_kw), WorkerOptions(**opt_kw), dynamo_required=False)
    prepare(_cfg(), WorkerOptions(), dynamo_required=False)


def test_discovery_banner() -> None:
    endpoint = prepare(_cfg(grpc_endpoint=" grpc://[::1]:50051 "), WorkerOptions(), dynamo_required=False)
    assert discovery_banner(endpoint, 1800.0) == (
        "Discovering vLLM model metadata from http://[::1]:50051; startup deadline: 1800s"
    )


def test_config_objects_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        _cfg().grpc_connections = 3  # type: ignore[misc]
    assert WorkerOptions(endpoint_types="chat, Completions").endpoint_types == ("chat", "completions")


def test_keepalive_config_of_the_vllm_connections() -> None:
    from trio_sidecar.core.config import KeepaliveConfig, keepalive_config

    assert keepalive_config(_cfg()) == KeepaliveConfig.client(
        time=10.0, timeout=4.0, min_ping_interval_without_data=300.0
    )
    assert keepalive_config(_cfg(keepalive_time=0)).time is None  # 0: no keepalive
    assert keepalive_config(_cfg(keepalive_min_ping_interval=2.5)).min_ping_interval_without_data == 2.5


def test_a_prefill_worker_ignores_its_endpoint_types_as_native_does() -> None:
    prepare(_cfg(disaggregation_mode="prefill"), WorkerOptions(endpoint_types="foo"), dynamo_required=False)
    with pytest.raises(InvalidArgument, match="unknown endpoint type 'foo'"):
        prepare(_cfg(disaggregation_mode="decode"), WorkerOptions(endpoint_types="foo"), dynamo_required=False)


def test_configured_parsers_pass_the_checks() -> None:
    options = WorkerOptions(tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    prepare(_cfg(), options, dynamo_required=False)
    assert (options.tool_call_parser, options.reasoning_parser) == ("hermes", "deepseek_r1")


@pytest.mark.parametrize(
    ("types", "names"),
    [
        ("chat", ("Chat",)),
        ("Completions,chat", ("Completions", "Chat")),
        ("chat,,chat, embeddings", ("Chat", "Embedding")),
        ("embedding", ("Embedding",)),
        ("image,audios,VIDEO,tensor", ("Images", "Audios", "Videos", "TensorBased")),
    ],
)
def test_endpoint_types_are_native_model_types(types: str, names: tuple[str, ...]) -> None:
    options = WorkerOptions(endpoint_types=types)
    prepare(_cfg(), options, dynamo_required=False)
    assert config_module.model_type_names(options.endpoint_types) == names
