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

import cattrs

from ._signals import (
    Interrupted,
    forget_held,
    held,
    install_interrupt_handlers,
    interrupted_exit,
    restore_handlers,
)
from .core.config import DisaggregationMode, SidecarConfig, WorkerOptions, discovery_banner, prepare
from .core.endpoint import GrpcEndpoint
from .core.errors import SidecarError
from .core.run_options import OPTIONS, Option, UsageError, convert, parse_bool

__all__ = ["main", "parse_run_args", "UsageError", "OPTIONS", "parse_bool"]

PROG = "trio-sidecar"


_SENTINEL: Any = object()


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
    from .versions import print_report, version_lines

    print_report(version_lines())


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
            value = convert(opt, raw, f"`{opt.flag}`")
        elif opt.env is not None and opt.env in environ:
            value = convert(opt, environ[opt.env], f"environment variable {opt.env}")
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
        code = _main(argv, environ)
        swallowed = held()  # raised inside a callback that ate it, and no Trio run took it over
        return interrupted_exit(swallowed[0]) if swallowed else code
    except Interrupted as exc:
        forget_held()
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
        from .versions import environment_lines, print_report

        print_report(environment_lines())
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
