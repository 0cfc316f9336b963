"""``trio-sidecar run`` flags and environment (docs/reference/sidecar.md#configuration, docs/reference/sidecar.md#exit-codes,
docs/reference/worker.md#graceful-shutdown-and-drain)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from trio_sidecar import __version__
from trio_sidecar.__main__ import main as dunder_main
from trio_sidecar.cli import OPTIONS, UsageError, main, parse_bool, parse_run_args
from trio_sidecar.core import config as config_module
from trio_sidecar.core.config import DYNAMO_EXTRA_MISSING, DisaggregationMode, SidecarConfig, WorkerOptions

EP = ["--grpc-endpoint", "127.0.0.1:50051"]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> list[tuple[SidecarConfig, WorkerOptions]]:
    """A stand-in for ``trio_sidecar.dynamo.worker`` that records its calls and returns 0."""
    calls: list[tuple[SidecarConfig, WorkerOptions]] = []

    def run_worker(config: SidecarConfig, options: WorkerOptions) -> int:
        calls.append((config, options))
        return 0

    module = types.ModuleType("trio_sidecar.dynamo.worker")
    module.run_worker = run_worker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trio_sidecar.dynamo.worker", module)
    monkeypatch.setattr(config_module, "dynamo_available", lambda: True)
    return calls


def test_defaults() -> None:
    cfg, opts = parse_run_args(EP, environ={})
    assert cfg == SidecarConfig(grpc_endpoint="127.0.0.1:50051")
    assert (cfg.grpc_connections, cfg.connect_attempt_timeout, cfg.retry_interval, cfg.startup_deadline) == (
        8,
        30,
        1,
        1800,
    )
    assert opts == WorkerOptions()
    assert opts.discovery_backend == "etcd" and opts.event_plane is None


def test_flags_override() -> None:
    cfg, _ = parse_run_args(
        EP
        + [
            "--grpc-connections", "2",
            "--grpc-connect-attempt-timeout-secs", "7",
            "--grpc-retry-interval-secs", "3",
            "--grpc-startup-deadline-secs", "11",
        ],
        environ={},
    )  # fmt: skip
    assert (cfg.grpc_connections, cfg.connect_attempt_timeout, cfg.retry_interval, cfg.startup_deadline) == (
        2,
        7,
        3,
        11,
    )


ENV = {
    "DYN_SIDECAR_GRPC_ENDPOINT": "grpc://envhost:1",
    "DYN_SIDECAR_GRPC_CONNECTIONS": "2",
    "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS": "7",
    "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS": "3",
    "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS": "11",
}


def test_env_overrides_defaults_and_flags_override_env() -> None:
    cfg, _ = parse_run_args([], environ=ENV)
    assert cfg.grpc_endpoint == "grpc://envhost:1"
    assert (cfg.grpc_connections, cfg.connect_attempt_timeout, cfg.retry_interval, cfg.startup_deadline) == (
        2,
        7,
        3,
        11,
    )
    cfg, _ = parse_run_args(["--grpc-connections", "5", "--grpc-endpoint", "h:2"], environ=ENV)
    assert (cfg.grpc_connections, cfg.grpc_endpoint, cfg.retry_interval) == (5, "h:2", 3)


# (flag, env, flag value, env value, attribute, expected python value)
TABLE: list[tuple[str, str, str, str, str, Any]] = [
    ("--namespace", "DYN_NAMESPACE", "ns1", "ns2", "namespace", None),
    ("--component", "DYN_COMPONENT", "c1", "c2", "component", None),
    ("--endpoint", "DYN_ENDPOINT", "e1", "e2", "endpoint", None),
    ("--custom-jinja-template", "DYN_CUSTOM_JINJA_TEMPLATE", "/t1", "/t2", "custom_jinja_template", None),
    ("--dyn-tool-call-parser", "DYN_TOOL_CALL_PARSER", "hermes", "x", "tool_call_parser", None),
    ("--dyn-reasoning-parser", "DYN_REASONING_PARSER", "r1", "r2", "reasoning_parser", None),
    ("--vllm-http-endpoint", "VLLM_HTTP_ENDPOINT", "http://a", "http://b", "vllm_http_endpoint", None),
    ("--discovery-backend", "DYN_DISCOVERY_BACKEND", "file", "mem", "discovery_backend", None),
    ("--request-plane", "DYN_REQUEST_PLANE", "nats", "tcp", "request_plane", None),
    ("--response-plane", "DYN_RESPONSE_PLANE", "quic", "tcp", "response_plane", None),
    ("--event-plane", "DYN_EVENT_PLANE", "nats", "zmq", "event_plane", None),
    ("--log-level", "TRIO_SIDECAR_LOG_LEVEL", "debug", "warning", "log_level", None),
]


@pytest.mark.parametrize(("flag", "env", "fval", "eval_", "attr", "_x"), TABLE)
def test_string_options_flag_env_default(flag: str, env: str, fval: str, eval_: str, attr: str, _x: Any) -> None:
    default = getattr(WorkerOptions(), attr)
    assert getattr(parse_run_args(EP, environ={})[1], attr) == default
    assert getattr(parse_run_args(EP, environ={env: eval_})[1], attr) == eval_
    assert getattr(parse_run_args(EP + [flag, fval], environ={env: eval_})[1], attr) == fval


def test_endpoint_types() -> None:
    assert parse_run_args(EP + ["--endpoint-types", "chat"], environ={})[1].endpoint_types == ("chat",)
    assert parse_run_args(EP, environ={"DYN_ENDPOINT_TYPES": "completions"})[1].endpoint_types == ("completions",)
    assert parse_run_args(EP + ["--endpoint-types", " Chat , embeddings,"], environ={})[1].endpoint_types == (
        "chat",
        "embeddings",
    )


def test_parser_names_are_kept_as_given() -> None:
    """Like native: an empty or blank name (flag or environment) is registered as it is, not dropped."""
    _, options = parse_run_args(EP + ["--dyn-tool-call-parser", ""], environ={"DYN_REASONING_PARSER": " "})
    assert (options.tool_call_parser, options.reasoning_parser) == ("", " ")


def test_rl_world_size_and_numbers() -> None:
    assert parse_run_args(EP + ["--vllm-rl-world-size", "4"], environ={})[1].vllm_rl_world_size == 4
    assert parse_run_args(EP, environ={"DYN_VLLM_RL_WORLD_SIZE": "2"})[1].vllm_rl_world_size == 2


@pytest.mark.parametrize("text", ["true", "TRUE", "1", "yes", "On"])
def test_bool_true(text: str) -> None:
    assert parse_bool(text, "x") is True


@pytest.mark.parametrize("text", ["false", "False", "0", "no", "OFF"])
def test_bool_false(text: str) -> None:
    assert parse_bool(text, "x") is False


def test_bool_invalid() -> None:
    with pytest.raises(UsageError, match="invalid boolean value `maybe` for environment variable X"):
        parse_bool("maybe", "environment variable X")


@pytest.mark.parametrize(
    ("flag", "no_flag", "env", "attr", "target"),
    [
        ("--health-prober", "--no-health-prober", "TRIO_SIDECAR_HEALTH_PROBER", "health_prober", 0),
        ("--abort-on-cancel", "--no-abort-on-cancel", "TRIO_SIDECAR_ABORT_ON_CANCEL", "abort_on_cancel", 0),
    ],
)
def test_flag_pairs(flag: str, no_flag: str, env: str, attr: str, target: int) -> None:
    assert getattr(parse_run_args(EP, environ={})[target], attr) is True
    assert getattr(parse_run_args(EP + [no_flag], environ={})[target], attr) is False
    assert getattr(parse_run_args(EP, environ={env: "off"})[target], attr) is False
    assert getattr(parse_run_args(EP + [flag], environ={env: "0"})[target], attr) is True
    assert getattr(parse_run_args(EP + [no_flag], environ={env: "yes"})[target], attr) is False


@pytest.mark.parametrize(
    ("flag", "env", "attr"),
    [("--route-to-encoder", "DYN_ROUTE_TO_ENCODER", "route_to_encoder"), ("--enable-rl", "DYN_ENABLE_RL", "enable_rl")],
)
def test_switches(flag: str, env: str, attr: str) -> None:
    assert getattr(parse_run_args(EP, environ={})[1], attr) is False
    assert getattr(parse_run_args(EP + [flag], environ={})[1], attr) is True
    assert getattr(parse_run_args(EP, environ={env: "yes"})[1], attr) is True
    assert getattr(parse_run_args(EP, environ={env: "false"})[1], attr) is False


def test_exclude_tools_takes_a_value() -> None:
    assert parse_run_args(EP, environ={})[1].exclude_tools_when_tool_choice_none is True
    opts = parse_run_args(EP + ["--exclude-tools-when-tool-choice-none", "false"], environ={})[1]
    assert opts.exclude_tools_when_tool_choice_none is False
    env = {"DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE": "no"}
    assert parse_run_args(EP, environ=env)[1].exclude_tools_when_tool_choice_none is False


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("agg", DisaggregationMode.AGG),
        ("aggregated", DisaggregationMode.AGG),
        ("prefill", DisaggregationMode.PREFILL),
        ("decode", DisaggregationMode.DECODE),
        ("encode", DisaggregationMode.ENCODE),
    ],
)
def test_disaggregation_mode(value: str, mode: DisaggregationMode) -> None:
    assert parse_run_args(EP + ["--disaggregation-mode", value], environ={})[0].disaggregation_mode is mode
    env = {"DYN_DISAGGREGATION_MODE": value}
    assert parse_run_args(EP, environ=env)[0].disaggregation_mode is mode


def test_project_durations() -> None:
    _, opts = parse_run_args(EP, environ={})
    assert (opts.unserving_grace, opts.drain_timeout) == (5.0, 30.0)
    _, opts = parse_run_args(
        EP, environ={"TRIO_SIDECAR_UNSERVING_GRACE_SECS": "2", "TRIO_SIDECAR_DRAIN_TIMEOUT_SECS": "9"}
    )
    assert (opts.unserving_grace, opts.drain_timeout) == (2.0, 9.0)
    _, opts = parse_run_args(
        EP + ["--unserving-grace-secs", "0", "--drain-timeout-secs", "1.5"],
        environ={"TRIO_SIDECAR_DRAIN_TIMEOUT_SECS": "9"},
    )
    assert (opts.unserving_grace, opts.drain_timeout) == (0.0, 1.5)
    with pytest.raises(UsageError, match="`--drain-timeout-secs` must be a finite, non-negative"):
        parse_run_args(EP + ["--drain-timeout-secs", "-1"], environ={})


def test_keepalive_flags_and_environment() -> None:
    config, _ = parse_run_args(EP, environ={})
    assert (config.keepalive_time, config.keepalive_timeout) == (10.0, 4.0)
    env = {"TRIO_SIDECAR_GRPC_KEEPALIVE_TIME_SECS": "2.5", "TRIO_SIDECAR_GRPC_KEEPALIVE_TIMEOUT_SECS": "1"}
    config, _ = parse_run_args(EP, environ=env)
    assert (config.keepalive_time, config.keepalive_timeout) == (2.5, 1.0)
    config, _ = parse_run_args(
        EP + ["--grpc-keepalive-time-secs", "0", "--grpc-keepalive-timeout-secs", "0.5"], environ=env
    )
    assert (config.keepalive_time, config.keepalive_timeout) == (0.0, 0.5)  # flags win; 0 disables keepalive
    with pytest.raises(UsageError, match="`--grpc-keepalive-timeout-secs` must be a finite, positive"):
        parse_run_args(EP + ["--grpc-keepalive-timeout-secs", "0"], environ={})
    with pytest.raises(UsageError, match="TRIO_SIDECAR_GRPC_KEEPALIVE_TIME_SECS"):
        parse_run_args(EP, environ={"TRIO_SIDECAR_GRPC_KEEPALIVE_TIME_SECS": "-1"})
    assert config.keepalive_min_ping_interval == 300.0  # gRPC-core's server default
    config, _ = parse_run_args(EP, environ={"TRIO_SIDECAR_GRPC_KEEPALIVE_MIN_PING_INTERVAL_SECS": "12"})
    assert config.keepalive_min_ping_interval == 12.0
    config, _ = parse_run_args(EP + ["--grpc-keepalive-min-ping-interval-secs", "1.5"], environ={})
    assert config.keepalive_min_ping_interval == 1.5
    with pytest.raises(UsageError, match="`--grpc-keepalive-min-ping-interval-secs` must be a finite, positive"):
        parse_run_args(EP + ["--grpc-keepalive-min-ping-interval-secs", "0"], environ={})


NUMERIC = [
    ("--grpc-connections", "DYN_SIDECAR_GRPC_CONNECTIONS"),
    ("--grpc-connect-attempt-timeout-secs", "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS"),
    ("--grpc-retry-interval-secs", "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS"),
    ("--grpc-startup-deadline-secs", "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS"),
]


@pytest.mark.parametrize(("flag", "env"), NUMERIC)
def test_numeric_flags_reject_zero_with_exit_2(
    flag: str, env: str, worker: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *EP, flag, "0"], environ={}) == 2
    err = capsys.readouterr().err
    assert f"error: `{flag}` must be at least 1" in err
    assert main(["run", *EP], environ={env: "0"}) == 2
    err = capsys.readouterr().err
    assert f"`{flag}` must be at least 1" in err and env in err
    assert worker == []


@pytest.mark.parametrize(("flag", "env"), NUMERIC)
def test_numeric_flags_reject_non_decimal(flag: str, env: str) -> None:
    for bad in ("1.5", "abc", "", "0x10"):
        with pytest.raises(UsageError, match="expected a decimal integer"):
            parse_run_args(EP + [flag, bad], environ={})
    with pytest.raises(UsageError, match=f"environment variable {env}"):
        parse_run_args(EP, environ={env: "ten"})


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--discovery-backend", "zookeeper"], {}, "expected one of kubernetes, etcd, file, mem"),
        ([], {"DYN_REQUEST_PLANE": "udp"}, "environment variable DYN_REQUEST_PLANE"),
        (["--log-level", "loud"], {}, "expected one of debug, info, warning, error"),
        (["--disaggregation-mode", "both"], {}, "expected one of agg, aggregated, prefill, decode, encode"),
        ([], {"TRIO_SIDECAR_HEALTH_PROBER": "perhaps"}, "invalid boolean value `perhaps`"),
    ],
)
def test_bad_values_exit_2(
    args: list[str], env: dict, message: str, worker: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *EP, *args], environ=env) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert worker == []


def test_unknown_flag_exits_2(worker: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *EP, "--bogus"], environ={}) == 2
    assert "error: unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--vllm-http-endpoint", ""],
            {},
            "`--vllm-http-endpoint` is required and must specify an HTTP server address",
        ),
        ([], {"VLLM_HTTP_ENDPOINT": "ftp://x"}, "`--vllm-http-endpoint` must use HTTP or HTTPS and include a host"),
        (["--vllm-rl-world-size", "4294967296"], {}, "`--vllm-rl-world-size` must be between 1 and 4294967295"),
        (["--endpoint-types", "chat,rerank"], {}, "unknown endpoint type 'rerank'"),
        ([], {"DYN_ENDPOINT_TYPES": ""}, "endpoint_types cannot be empty"),
        (["--grpc-endpoint", "https://server"], {}, "TLS endpoints are not supported by `--grpc-endpoint`"),
    ],
)
def test_prepare_failures_exit_2(
    args: list[str], env: dict, message: str, worker: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *EP, *args], environ=env) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Discovering vLLM model metadata" not in err
    assert worker == []


def test_missing_endpoint_exits_2(worker: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run"], environ={}) == 2
    assert "`--grpc-endpoint` is required and must specify a gRPC server address" in capsys.readouterr().err


def test_missing_dynamo_extra_exits_2(
    worker: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(config_module, "dynamo_available", lambda: False)
    assert main(["run", *EP], environ={}) == 2
    assert f"error: {DYNAMO_EXTRA_MISSING}" in capsys.readouterr().err
    assert worker == []


def test_run_calls_worker_after_banner(worker: list, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["run", "--grpc-endpoint", "grpc://[::1]:50051", "--grpc-startup-deadline-secs", "5",
         "--disaggregation-mode", "aggregated", "--no-abort-on-cancel", "--component", "custom"],
        environ={"DYN_NAMESPACE": "ns"},
    )  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "Discovering vLLM model metadata from http://[::1]:50051; startup deadline: 5s\n" in err
    [(cfg, opts)] = worker
    assert cfg.grpc_endpoint == "grpc://[::1]:50051" and cfg.startup_deadline == 5
    assert cfg.disaggregation_mode is DisaggregationMode.AGG and cfg.abort_on_cancel is False
    assert (opts.namespace, opts.component) == ("ns", "custom")


def test_run_returns_the_worker_exit_code(worker: list, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.modules["trio_sidecar.dynamo.worker"].run_worker = lambda c, o: 1  # type: ignore[attr-defined]
    assert main(["run", *EP], environ={}) == 1


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"], environ={}) == 0
    out = capsys.readouterr().out
    for opt in OPTIONS:
        assert opt.flag in out
        if opt.env:
            assert opt.env in out
    assert main(["run", "--version"], environ={}) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"trio-sidecar {__version__}")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"trio-sidecar {__version__}")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "mock" in out
    assert dunder_main(["--version"]) == 0


def test_no_command_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["serve"]) == 2
    assert "error: unknown command `serve`" in capsys.readouterr().err


def test_mock_delegates(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    module = types.ModuleType("trio_sidecar.mock.cli")
    module.main = lambda argv: seen.append(list(argv)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trio_sidecar.mock.cli", module)
    import trio_sidecar.mock as mock_pkg

    monkeypatch.setattr(mock_pkg, "cli", module, raising=False)
    assert main(["mock", "--listen", "127.0.0.1:0"]) == 7
    assert seen == [["--listen", "127.0.0.1:0"]]


def test_error_text_is_not_rich_markup(worker: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--grpc-endpoint", "other://[x]"], environ={}) == 2
    assert "unsupported endpoint scheme in `--grpc-endpoint`: `other://[x]`" in capsys.readouterr().err


def test_configured_parsers_reach_the_worker(worker: list) -> None:
    env = {"DYN_REASONING_PARSER": "deepseek_r1"}
    assert (
        main(["run", *EP, "--dyn-tool-call-parser", "hermes", "--endpoint-types", "chat,embeddings"], environ=env) == 0
    )
    ((_, options),) = worker
    assert (options.tool_call_parser, options.reasoning_parser) == ("hermes", "deepseek_r1")
    assert options.endpoint_types == ("chat", "embeddings")
