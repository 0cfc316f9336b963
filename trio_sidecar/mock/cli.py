"""``trio-sidecar mock``: run the mock vLLM gRPC server as a process (docs/reference/mock.md#cli, docs/reference/mock.md#startup-and-shutdown).

Exit codes (docs/reference/sidecar.md#exit-codes, the same as ``trio-sidecar run``): 0 after SIGINT/SIGTERM (graceful shutdown); 2 for
a usage or configuration error found before any socket is opened (bad flag, bad engine JSON, invalid engine
arguments); 1 for a failure after that (e.g. the listen address cannot be bound); a second SIGINT/SIGTERM
during shutdown exits 1 at once. Errors are printed as ``error: {message}``, like ``run``'s.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import trio

from trio_sidecar._logging import configure_logging, print_error
from trio_sidecar._signals import SIGNALS, held, hold_signals
from trio_sidecar.mock.engine_args import EngineArgsError, parse_engine_args

if TYPE_CHECKING:
    from trio_sidecar.mock.server import MockConfig

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
    parser.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        metavar="IP:PORT",
        help="gRPC listen address: a literal IPv4 or bracketed IPv6 address and a port (0 = OS-chosen); "
        "ZMQ KV-event sockets bind the same IP (default: %(default)s)",
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
        "weights - and serve it as --model, so Dynamo's frontend needs no download (needs the `tokenizers` "
        "package, which Dynamo brings)",
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
    parser.add_argument(
        "--extra-engine-args",
        default=None,
        metavar="JSON|PATH",
        help="flat JSON object of engine arguments (block_size, num_gpu_blocks, max_num_seqs, "
        "max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, speedup_ratio, "
        "decode_speedup_ratio, dp_size, max_model_len, preemption_mode, zmq_kv_events_port, "
        "zmq_replay_port, token_seed_source, image_token_id, tokens_per_image, text_mode, max_loras, "
        "enable_sleep_mode, weight_transfer_backend, enable_draft_weight_updates, ...): inline when "
        "the value starts with '{', otherwise a path to a JSON file. text_mode \"tags\" (default): each token's "
        'text is <token:ID>; "bytes": each token is one to three UTF-8 bytes, detokenized incrementally '
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
    from trio_sidecar.mock.server import MockConfig, MockConfigError, prepare_config

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
        config = MockConfig(
            listen=ns.listen,
            model=model,
            served_model_name=served_model_name,
            disaggregation_mode=ns.disaggregation_mode,
            seed=ns.seed,
            max_concurrent_requests=ns.max_concurrent_requests,
            engine_args=parse_engine_args(ns.extra_engine_args),
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
    return trio.run(_serve, config)


class _TinyModelError(Exception):
    pass


def _tiny_model(directory: str) -> str:
    """Build (or reuse) the tiny model directory; returns its absolute path."""
    try:
        from trio_sidecar.mock.tiny_model import make_tiny_model

        return str(make_tiny_model(directory))
    except ImportError:
        raise _TinyModelError(
            "--tiny-model needs the `tokenizers` package (pip install tokenizers; `make install` brings it with Dynamo)"
        ) from None
    except OSError as exc:
        raise _TinyModelError(f"cannot create the tiny model directory '{directory}': {exc}") from None


async def _serve(config: MockConfig) -> int:
    from trio_sidecar.mock.server import open_mock_server

    with trio.open_signal_receiver(*SIGNALS) as signals:
        early = held()
        try:
            async with open_mock_server(config) as mock:
                print(f"trio-sidecar mock listening on {mock.address}", flush=True)
                signum = early[0] if early else await signals.__anext__()
                logging.getLogger("trio_sidecar.mock").info("received %s, shutting down", signal.Signals(signum).name)
                if len(early) > 1:  # the second signal arrived already: exit 1 at once
                    sys.stderr.flush()
                    os._exit(1)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_exit_on_second_signal, signals)
                    await mock.graceful_shutdown()
                    nursery.cancel_scope.cancel()
        except OSError as exc:
            print_error(_bind_error(config.listen, exc))
            return 1
    return 0


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
