"""``trio-sidecar mock``: run the mock vLLM gRPC server as a process (docs/reference/mock.md#cli, docs/reference/mock.md#startup-and-shutdown).

Exit codes (docs/reference/sidecar.md#exit-codes, the same as ``trio-sidecar run``): 0 after SIGINT/SIGTERM (graceful shutdown); 2 for
a usage or configuration error found before any socket is opened (bad flag, bad engine JSON, invalid engine
arguments); 1 for a failure after that (e.g. the listen address cannot be bound); a second SIGINT/SIGTERM
during shutdown exits 1 at once. Errors are printed as ``error: {message}``, like ``run``'s.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_sidecar._logging import configure_logging, print_error
from trio_sidecar._signals import SIGNALS, held, hold_signals
from trio_sidecar.mock.engine_args import (
    EngineArgs,
    EngineArgsError,
    TextMode,
    engine_args_from_mapping,
    load_engine_args_text,
    parse_engine_args,
)
from trio_sidecar.transport import collapse_single_exception

if TYPE_CHECKING:
    from trio_sidecar.mock.config import MockConfig

__all__ = ["build_parser", "main"]

LOG_LEVEL_ENV = "TRIO_SIDECAR_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")
PROG = "trio-sidecar mock"


def _u64(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid unsigned 64-bit integer: '{text}'") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"invalid unsigned 64-bit integer: '{text}'")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: '{text}'") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: '{text}'")
    return value


def _idle_seconds(text: str) -> float | None:
    try:
        if float(text) == 0:
            return None
    except ValueError:
        pass
    return _positive_seconds(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: '{text}'")
    return value


def _port(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: '{text}'") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port: '{text}' (expected 0-65535)")
    return value


def _text(text: str) -> str:
    return text


#: dynamo.mocker's first-class engine flags (``python -m dynamo.mocker --help``): (flag, engine-args key,
#: argparse type, help). The values go through the same checks as the JSON's (``engine_args_from_mapping``).
ENGINE_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--block-size", "block_size", int, "tokens per KV-cache block (default: 64)"),
    ("--num-gpu-blocks-override", "num_gpu_blocks", int, "KV-cache blocks per data-parallel rank (default: 16384)"),
    ("--max-num-seqs", "max_num_seqs", int, "running requests per rank; 0 = unlimited (default: 256)"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        int,
        "tokens per scheduler pass; 0 = unlimited (default: 8192)",
    ),
    ("--max-model-len", "max_model_len", int, "prompt + generated tokens per request (default: no limit)"),
    (
        "--speedup-ratio",
        "speedup_ratio",
        float,
        "divides the modelled pass durations; 0 = no simulated delays (default: 1.0)",
    ),
    ("--decode-speedup-ratio", "decode_speedup_ratio", float, "an extra divisor for decode passes (default: 1.0)"),
    ("--data-parallel-size", "dp_size", int, "simulated data-parallel ranks (default: 1)"),
    ("--enable-prefix-caching", "enable_prefix_caching", bool, "automatic prefix caching (default: on)"),
    ("--enable-chunked-prefill", "enable_chunked_prefill", bool, "chunked prefill (default: on)"),
    ("--preemption-mode", "preemption_mode", _text, "lifo (default, as vLLM) or fifo"),
)


class _VersionAction(argparse.Action):
    """``--version``: the same report as ``trio-sidecar --version`` (the mock is part of the package)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from trio_sidecar.versions import print_report, version_lines

        print_report(version_lines())
        parser.exit()


class UsageError(Exception):
    """A bad command line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing its own ``prog: error:`` and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "CPU-only mock vLLM gRPC server: vllm.Inference, vllm.Control and grpc.health.v1.Health on one "
            "port, deterministic synthetic tokens, a simulated continuous-batching scheduler and paged KV "
            "cache, ZMQ KV events and prefill/decode wire emulation. Once serving it prints "
            "'trio-sidecar mock listening on IP:PORT' to stdout. SIGINT/SIGTERM shut it down gracefully."
        ),
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the version report and exit")
    parser.add_argument(
        "--listen",
        default=None,
        metavar="IP:PORT",
        help="gRPC listen address: a literal IPv4 or bracketed IPv6 address and a port (0 = OS-chosen); "
        "ZMQ KV-event sockets and the metrics listener bind the same IP (default: 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--host",
        default=None,
        metavar="IP",
        help="gRPC listen IP, as vLLM's --host (a literal IPv4 or IPv6 address; default: 127.0.0.1); not with --listen",
    )
    parser.add_argument(
        "--grpc-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="gRPC listen port, as vLLM's --grpc-port (0 = OS-chosen; default: 50051); not with --listen",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve vLLM-named Prometheus metrics at http://IP:PORT/metrics on the gRPC listen IP (0 = OS-chosen; "
        "default: no metrics listener); once serving, prints 'trio-sidecar mock metrics on http://IP:PORT/metrics'",
    )
    parser.add_argument(
        "--model",
        default="mocker-model",
        help="ModelInfo.model_id, and the served name unless --served-model-name is given (default: %(default)s)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="ModelInfo.served_model_name (default: --model; 'tiny' with --tiny-model)",
    )
    parser.add_argument(
        "--tiny-model",
        default=None,
        metavar="DIR",
        help="create (or reuse) a tiny local model directory at DIR - tokenizer, chat template and config, no "
        "weights - and serve it as --model, so Dynamo's frontend needs no download; its tokens' text is words "
        '(text_mode "words" unless --extra-engine-args names one; needs the `mock` extra: '
        "pip install 'trio-sidecar[mock]')",
    )
    parser.add_argument(
        "--disaggregation-mode",
        default="aggregated",
        choices=("aggregated", "agg", "prefill", "decode", "encode"),
        help="wire-level role to emulate; 'agg' is an alias of 'aggregated' (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=_u64, default=42, help="seed for token ids, request UUIDs and logprobs (default: %(default)s)"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=_non_negative_int,
        default=256,
        metavar="N",
        help="Generate/GenerateStream calls admitted at once, including queued ones (default: %(default)s)",
    )
    engine = parser.add_argument_group(
        "engine arguments",
        "dynamo.mocker's flags for the common engine arguments; each wins over the same key in --extra-engine-args",
    )
    for flag, key, kind, text in ENGINE_FLAGS:
        if kind is bool:
            engine.add_argument(
                flag, "--no-" + flag[2:], dest=key, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            engine.add_argument(flag, dest=key, type=kind, default=None, metavar=key.upper(), help=text)
    parser.add_argument(
        "--extra-engine-args",
        default=None,
        metavar="JSON|PATH",
        help="flat JSON object of engine arguments (block_size, num_gpu_blocks, max_num_seqs, "
        "max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, speedup_ratio, "
        "decode_speedup_ratio, dp_size, max_model_len, preemption_mode, zmq_kv_events_port, "
        "zmq_replay_port, token_seed_source, image_token_id, tokens_per_image, text_mode, scripted_completions, "
        "max_loras, "
        "enable_sleep_mode, weight_transfer_backend, enable_draft_weight_updates, ...): inline when "
        "the value starts with '{', otherwise a path to a JSON file. text_mode \"tags\" (default): each token's "
        'text is <token:ID>; "words": a space and a word of the tiny model\'s vocabulary; "bytes": each token is one to three UTF-8 bytes, detokenized incrementally '
        'like vLLM (a message whose character is incomplete carries text "", a later one the completed '
        "character; U+FFFD for invalid bytes and, on finish, for an incomplete tail)",
    )
    parser.add_argument(
        "--supports-multimodal",
        action="store_true",
        help="advertise and accept image media (placeholders in token_ids are expanded)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="close a connection that has not sent the HTTP/2 preface and SETTINGS within this time "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_idle_seconds,
        default=300.0,
        metavar="SECONDS",
        help="send GOAWAY and close a connection that has had no open stream for this long; 0 = never "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="connections served at once; further ones are closed on accept, with one WARNING log line "
        "per 10 s while it lasts (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default=None,
        choices=LOG_LEVELS,
        help=f"log level (env {LOG_LEVEL_ENV}; default: info)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-sidecar mock`` with ``argv`` (without the program and subcommand names)."""
    from trio_sidecar.mock.config import MockConfig, MockConfigError, prepare_config

    parser = build_parser()
    try:
        ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 2
    except UsageError as exc:
        print_error(str(exc))
        return 2
    level = ns.log_level or os.environ.get(LOG_LEVEL_ENV, "info").strip().lower()
    if level not in LOG_LEVELS:
        print_error(f"invalid {LOG_LEVEL_ENV} '{level}': expected one of {', '.join(LOG_LEVELS)}")
        return 2
    model, served_model_name = ns.model, ns.served_model_name
    if ns.tiny_model is not None:
        try:
            model, served_model_name = _tiny_model(ns.tiny_model), served_model_name or "tiny"
        except _TinyModelError as exc:
            print_error(str(exc))
            return 2
    try:
        listen = _listen(ns)
    except UsageError as exc:
        print_error(str(exc))
        return 2
    try:
        config = MockConfig(
            listen=listen,
            model=model,
            served_model_name=served_model_name,
            disaggregation_mode=ns.disaggregation_mode,
            seed=ns.seed,
            max_concurrent_requests=ns.max_concurrent_requests,
            engine_args=_engine_args(ns, words=ns.tiny_model is not None),
            supports_multimodal=ns.supports_multimodal,
            record_requests=False,
            handshake_timeout=ns.handshake_timeout,
            idle_timeout=ns.idle_timeout,
            max_connections=ns.max_connections,
        )
        prepare_config(config)
    except (EngineArgsError, MockConfigError) as exc:
        print_error(str(exc))
        return 2
    configure_logging(level)
    hold_signals()  # a signal from here until the receiver is open is replayed by _serve
    return trio.run(_serve, config, ns.metrics_port)


def _listen(ns: argparse.Namespace) -> str:
    """``--listen``, or ``--host``/``--grpc-port`` (vLLM's names) as ``IP:PORT``."""
    if ns.listen is not None:
        if ns.host is not None or ns.grpc_port is not None:
            raise UsageError(f"--listen cannot be combined with --host or --grpc-port (see `{PROG} --help`)")
        return str(ns.listen)
    host = "127.0.0.1" if ns.host is None else ns.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{50051 if ns.grpc_port is None else ns.grpc_port}"


def _engine_args(ns: argparse.Namespace, *, words: bool = False) -> EngineArgs:
    """``--extra-engine-args`` with the first-class engine flags given on the command line applied over it;
    ``words``: ``text_mode`` "words" unless the JSON names a text mode (``--tiny-model``'s vocabulary)."""
    args = parse_engine_args(ns.extra_engine_args)
    if words and "text_mode" not in json.loads(load_engine_args_text(ns.extra_engine_args or "{}")):
        args = attrs.evolve(args, text_mode=TextMode.WORDS)
    given = {key: getattr(ns, key) for _, key, _, _ in ENGINE_FLAGS if getattr(ns, key) is not None}
    if not given:
        return args
    converted = engine_args_from_mapping(given)  # the JSON's checks and messages
    return attrs.evolve(args, **{key: getattr(converted, key) for key in given})


class _TinyModelError(Exception):
    pass


def _tiny_model(directory: str) -> str:
    """Build (or reuse) the tiny model directory; returns its absolute path."""
    try:
        from trio_sidecar.mock.tiny_model import make_tiny_model

        return str(make_tiny_model(directory))
    except ImportError:
        raise _TinyModelError(
            "--tiny-model needs the `tokenizers` package: pip install 'trio-sidecar[mock]' (`make install` brings it)"
        ) from None
    except OSError as exc:
        raise _TinyModelError(f"cannot create the tiny model directory '{directory}': {exc}") from None


async def _serve(config: MockConfig, metrics_port: int | None = None) -> int:
    with trio.open_signal_receiver(*SIGNALS) as signals:
        early = held()
        try:
            with collapse_single_exception():
                await _serve_until_signal(config, metrics_port, signals, early)
        except _MetricsBindError as exc:
            print_error(str(exc))
            return 1
        except OSError as exc:
            print_error(_bind_error(config.listen, exc))
            return 1
    return 0


async def _serve_until_signal(
    config: MockConfig, metrics_port: int | None, signals: AsyncIterator[int], early: list[int]
) -> None:
    from trio_sidecar.mock.server import open_mock_server

    async with open_mock_server(config) as mock, trio.open_nursery() as metrics_nursery:
        print(f"trio-sidecar mock listening on {mock.address}", flush=True)
        if metrics_port is not None:
            await _start_metrics(metrics_nursery, mock, metrics_port)
        signum = early[0] if early else await signals.__anext__()
        logging.getLogger("trio_sidecar.mock").info("received %s, shutting down", signal.Signals(signum).name)
        if len(early) > 1:  # the second signal arrived already: exit 1 at once
            sys.stderr.flush()
            os._exit(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exit_on_second_signal, signals)
            await mock.graceful_shutdown()
            nursery.cancel_scope.cancel()
        metrics_nursery.cancel_scope.cancel()


class _MetricsBindError(Exception):
    pass


async def _start_metrics(nursery: trio.Nursery, mock: Any, port: int) -> None:
    from trio_sidecar.mock.metrics import serve_metrics_http

    try:
        bound = await nursery.start(serve_metrics_http, mock.request_metrics, mock.host, port)
    except OSError as exc:
        raise _MetricsBindError(
            _bind_error(f"{mock.host}:{port}", exc).replace("--listen IP:PORT", "--metrics-port")
        ) from None
    host = f"[{mock.host}]" if ":" in mock.host else mock.host
    print(f"trio-sidecar mock metrics on http://{host}:{bound}/metrics", flush=True)


def _bind_error(listen: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {listen}: address already in use (another process holds the port; "
            f"choose another with --listen IP:PORT, or port 0 for a free one)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {listen}: the address is not on this host"
    return f"cannot listen on {listen}: {exc.strerror or exc}"


async def _exit_on_second_signal(signals: AsyncIterator[int]) -> None:
    async for _ in signals:
        sys.stderr.flush()
        os._exit(1)
