"""``trio-sidecar run`` / ``trio-sidecar mock``: argument and environment parsing (docs/reference/sidecar.md#configuration).

Precedence is flag > environment variable > default. argparse only collects raw strings (every default is
a sentinel, so an unset flag never hides its environment variable); values are then converted here with
the project's messages, and structured into ``SidecarConfig`` / ``WorkerOptions`` with cattrs.

Exit codes (docs/reference/sidecar.md#exit-codes): 0 clean shutdown, ``--help``, ``--version``; 2 usage or configuration
error before any socket is opened (including the pre-network checks, docs/reference/sidecar.md#pre-network-checks, and a missing ``dynamo`` extra); otherwise
whatever the worker returns (1 for failures after startup began).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs

from ._signals import Interrupted, install_interrupt_handlers, interrupted_exit, restore_handlers
from .config import DisaggregationMode, SidecarConfig, WorkerOptions, discovery_banner, prepare
from .endpoint import GrpcEndpoint
from .errors import SidecarError

__all__ = ["main", "parse_run_args", "UsageError", "OPTIONS", "parse_bool"]

PROG = "trio-sidecar"


class UsageError(Exception):
    """A bad command line or environment value (exit 2)."""


_SENTINEL: Any = object()

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
        "worker role; aggregated is an alias of agg (encode is rejected)",
        metavar="MODE",
        choices=("agg", "aggregated", "prefill", "decode"),
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
        "comma-separated endpoint types",
        metavar="TYPES",
        choices=("chat", "completions"),
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
        "opt_str",
        "must be unset (vLLM gRPC does not preserve the options the parsers need)",
        metavar="NAME",
    ),
    Option(
        "--dyn-reasoning-parser",
        "DYN_REASONING_PARSER",
        "reasoning_parser",
        "worker",
        None,
        "opt_str",
        "must be unset",
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
    Option("--route-to-encoder", "DYN_ROUTE_TO_ENCODER", "route_to_encoder", "worker", False, "switch", "must be off"),
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
        "nothing this long; 0 disables",
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


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class _Toggle(argparse.Action):
    """``--x`` sets True, ``--no-x`` sets False (one entry in ``--help``, like clap's paired flags)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


def _show_default(opt: Option) -> str | None:
    value = opt.default
    if value is None:
        return None
    if isinstance(value, bool):
        if opt.kind == "pair":
            return "on" if value else "off"
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    if value == "":
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _option_help(opt: Option) -> str:
    """The option's text, then its default, choices and environment variable (as native's --help shows)."""
    notes = []
    default = _show_default(opt)
    if default is not None and opt.kind != "switch":
        notes.append(f"default: {default}")
    if opt.choices:
        notes.append(f"choices: {', '.join(opt.choices)}")
    if opt.kind == "bool_value":
        notes.append("choices: true, false")
    if opt.env:
        notes.append(f"env: {opt.env}")
    text = opt.help + (f" [{'; '.join(notes)}]" if notes else "")
    return text.replace("%", "%%")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Never breaks a word at its hyphen (``trio-sidecar``, ``--no-health-prober`` stay whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


EXIT_CODES_HELP = """exit codes:
  0    clean shutdown after serving (SIGINT/SIGTERM, graceful drain); --help, --version
  1    failure after startup began (vLLM unreachable or not serving within the deadline, identity
       change, Dynamo runtime error); a second SIGINT/SIGTERM always exits 1 at once
  2    usage or configuration error, found before any socket is opened
  130  interrupted by SIGINT before serving (128 + signal number, as shells report it)
  143  interrupted by SIGTERM before serving

Every option also reads its environment variable (env: ...); a flag wins over its variable."""


class _VersionAction(argparse.Action):
    """``--version``: the report of :func:`trio_sidecar.versions.version_lines` (argparse's own prints one line)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print_version()
        parser.exit()


def print_version() -> None:
    from .versions import version_lines

    print("\n".join(version_lines()))


def _build_run_parser() -> _Parser:
    parser = _Parser(
        prog=f"{PROG} run",
        description="Serve a vLLM gRPC engine as an NVIDIA Dynamo worker.",
        epilog=EXIT_CODES_HELP,
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the version report and exit")
    for opt in OPTIONS:
        text = _option_help(opt)
        if opt.kind == "switch":
            parser.add_argument(opt.flag, dest=opt.dest, action="store_const", const=True, default=_SENTINEL, help=text)
        elif opt.kind == "pair":
            parser.add_argument(
                opt.flag, "--no-" + opt.flag[2:], dest=opt.dest, action=_Toggle, nargs=0, default=_SENTINEL, help=text
            )
        else:
            metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else "VALUE")
            parser.add_argument(opt.flag, dest=opt.dest, default=_SENTINEL, metavar=metavar, help=text)
    return parser


def _convert(opt: Option, raw: Any, source: str) -> Any:
    kind = opt.kind
    if kind in ("switch", "pair") and isinstance(raw, bool):
        return raw
    text = str(raw)
    if kind in ("switch", "pair", "bool_value"):
        return parse_bool(text, source)
    if kind == "str":
        return text
    if kind == "opt_str":
        return text if text.strip() else None
    if kind == "url":  # kept as given, empty included: checked and normalized by config.prepare
        return text
    if kind == "count":
        value = _decimal(text, source)
        if value < 1:
            raise UsageError(f"`{opt.flag}` must be at least 1" + _from_env(source))
        return value
    if kind == "opt_int":
        if not text.strip():
            return None
        value = _decimal(text, source)
        if value < 1:
            raise UsageError(f"`{opt.flag}` must be at least 1" + _from_env(source))
        return value
    if kind in ("secs", "pos_secs"):
        try:
            seconds = float(text.strip())
        except ValueError:
            raise UsageError(f"invalid value `{text}` for {source}: expected a number of seconds") from None
        if kind == "pos_secs" and not seconds > 0:
            raise UsageError(f"`{opt.flag}` must be a finite, positive number of seconds" + _from_env(source))
        if not seconds >= 0 or seconds == float("inf"):
            raise UsageError(f"`{opt.flag}` must be a finite, non-negative number of seconds" + _from_env(source))
        return seconds
    if kind in ("choice", "opt_choice"):
        lowered = text.strip().lower()
        if kind == "opt_choice" and not lowered:
            return None
        if lowered not in opt.choices:
            raise UsageError(f"invalid value `{text}` for {source}; expected one of {', '.join(opt.choices)}")
        return lowered
    if kind == "mode":
        lowered = text.strip().lower()
        if lowered != "aggregated" and lowered not in {m.value for m in DisaggregationMode}:
            raise UsageError(
                f"invalid value `{text}` for {source}; expected one of agg, aggregated, prefill, decode, encode"
            )
        return DisaggregationMode.parse(lowered)
    if kind == "endpoint_types":
        types = tuple(t.strip().lower() for t in text.split(",") if t.strip())
        if not types:
            raise UsageError(f"{source} must name at least one endpoint type (chat, completions)")
        for t in types:
            if t not in ("chat", "completions"):
                raise UsageError(f"invalid endpoint type `{t}` for {source}; expected chat or completions")
        return types
    raise AssertionError(kind)  # pragma: no cover


def _decimal(text: str, source: str) -> int:
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in "+-" else stripped
    if not digits.isascii() or not digits.isdigit():
        raise UsageError(f"invalid value `{text}` for {source}: expected a decimal integer")
    return int(stripped)


def _from_env(source: str) -> str:
    return f" (from {source})" if source.startswith("environment") else ""


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(DisaggregationMode, lambda v, _t: DisaggregationMode.parse(v))


def parse_run_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[SidecarConfig, WorkerOptions]:
    """Parse ``run``'s flags and environment into the two config objects.

    Raises:
        UsageError: an unknown flag or a bad value (exit 2). ``--help``/``--version`` raise ``SystemExit(0)``.
    """
    environ = os.environ if environ is None else environ
    namespace = _build_run_parser().parse_args(list(argv))
    values: dict[str, dict[str, Any]] = {"sidecar": {}, "worker": {}}
    for opt in OPTIONS:
        raw = getattr(namespace, opt.dest)
        if raw is not _SENTINEL:
            value = _convert(opt, raw, f"`{opt.flag}`")
        elif opt.env is not None and opt.env in environ:
            value = _convert(opt, environ[opt.env], f"environment variable {opt.env}")
        else:
            value = opt.default
        values[opt.target][opt.dest] = value
    try:
        config = _converter.structure(values["sidecar"], SidecarConfig)
        options = _converter.structure(values["worker"], WorkerOptions)
    except Exception as exc:  # cattrs raises ExceptionGroup subclasses: report them as one usage error
        raise UsageError("; ".join(_error_lines(exc))) from None
    return config, options


def _error_lines(exc: BaseException) -> list[str]:
    try:
        return list(cattrs.transform_error(exc))  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - transform_error only understands cattrs' errors
        return [str(exc)]


def _print_error(message: str) -> None:
    from ._logging import print_error

    print_error(message)


def _port_warning(endpoint: GrpcEndpoint, raw: str) -> str | None:
    """A warning when the endpoint names no port (the connection then goes to port 80)."""
    if endpoint.canonical.rsplit(":", 1)[-1].isdigit():
        return None
    return (
        f"`--grpc-endpoint` `{raw.strip()}` has no port, so port {endpoint.port} is used; vLLM's gRPC "
        f"server listens on its --grpc-port (e.g. `{endpoint.url_host}:50051`)"
    )


def _run(argv: Sequence[str], environ: Mapping[str, str] | None) -> int:
    from ._logging import use_dynamo_logging

    use_dynamo_logging(environ)  # before the first line: JSON lines when Dynamo's environment asks for them
    try:
        config, options = parse_run_args(argv, environ)
        endpoint = prepare(config, options, dynamo_required=True)
    except (UsageError, SidecarError) as exc:
        _print_error(str(exc))
        return 2
    from ._logging import configure_logging, emit

    emit(discovery_banner(endpoint, config.startup_deadline))
    warning = _port_warning(endpoint, config.grpc_endpoint)
    if warning is not None:
        emit(warning, level=logging.WARNING)
    configure_logging(options.log_level, environ=environ)
    logging.getLogger("trio_sidecar.cli").debug("configuration: %r; %r", config, options)
    from .dynamo.worker import run_worker  # lazy: imports the optional Dynamo extra

    return int(run_worker(config, options))


_TOP_USAGE = f"""usage: {PROG} [--help] [--version] {{run,mock,env}} ...

A Trio sidecar connecting vLLM's native gRPC services to NVIDIA Dynamo.

commands:
  run     serve a vLLM gRPC engine as a Dynamo worker ({PROG} run --help)
  mock    run the CPU-only mock vLLM gRPC server ({PROG} mock --help)
  env     print the versions a bug report needs (like `vllm collect-env`)
"""


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``trio-sidecar``; returns the exit code.

    Until a command's Trio run takes the signals over, SIGINT and SIGTERM end the process with one line and
    128 + the signal number (130, 143), never a traceback.
    """
    previous = install_interrupt_handlers()
    try:
        return _main(argv, environ)
    except Interrupted as exc:
        return interrupted_exit(exc.signum)
    except KeyboardInterrupt:
        return interrupted_exit(signal.SIGINT)
    finally:
        restore_handlers(previous)


def _main(argv: Sequence[str] | None, environ: Mapping[str, str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write(_TOP_USAGE)
        return 2
    if args[0] in ("-h", "--help"):
        sys.stdout.write(_TOP_USAGE)
        return 0
    if args[0] in ("--version", "-V"):
        print_version()
        return 0
    command, rest = args[0], args[1:]
    if command == "env":
        if rest:
            _print_error(f"`{PROG} env` takes no arguments")
            return 2
        from .versions import environment_lines

        print("\n".join(environment_lines()))
        return 0
    try:
        if command == "run":
            return _run(rest, environ)
        if command == "mock":
            from .mock.cli import main as mock_main

            return int(mock_main(rest))
    except SystemExit as exc:  # --help / --version inside a subcommand
        return _exit_code(exc)
    _print_error(f"unknown command `{command}`; expected `run`, `mock` or `env` (see `{PROG} --help`)")
    return 2


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
