"""The mock server's configuration and every check that needs no socket (docs/reference/mock.md#cli,
docs/reference/mock.md#startup-validation)."""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_sidecar.mock import engine_args as _engine_args
from trio_sidecar.mock import lora as _lora
from trio_sidecar.mock.handoff import Role
from trio_sidecar.mock.scripted import load_scripts
from trio_sidecar.mock.validation import RequestPolicy
from trio_sidecar.transport import ServerLimits

__all__ = ["MockConfig", "MockConfigError", "PreparedConfig", "parse_listen", "prepare_config"]


class MockConfigError(Exception):
    """An invalid mock configuration (listen address, mode, engine arguments). ``str(e)`` is the message."""


def parse_listen(text: str) -> tuple[str, int]:
    """Parse ``--listen``: ``IPv4:PORT`` or ``[IPv6]:PORT`` (a literal IP, never a host name).

    Raises:
        MockConfigError: anything else.
    """
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        version = 6
    else:
        version = 4
    try:
        ip = ipaddress.ip_address(host) if sep else None
    except ValueError:
        ip = None
    if ip is None or ip.version != version or not (port_text.isascii() and port_text.isdigit()):
        raise MockConfigError(f"invalid listen address '{text}': expected IP:PORT with a literal IP")
    port = int(port_text)
    if port > 65535:
        raise MockConfigError(f"invalid listen address '{text}': port must be 0..65535")
    return str(ip), port


@attrs.frozen(kw_only=True)
class MockConfig:
    """The mock server's configuration: the CLI's fields (docs/reference/mock.md#cli, docs/reference/mock.md#in-process-api-and-test-hooks)."""

    listen: str = "127.0.0.1:50051"
    model: str = "mocker-model"
    served_model_name: str | None = None
    disaggregation_mode: str = "aggregated"
    seed: int = 42
    max_concurrent_requests: int = 256
    engine_args: Mapping[str, Any] | _engine_args.EngineArgs | None = None
    supports_multimodal: bool = False
    #: Keep ``recorded_requests`` / ``abort_calls`` (test hooks). The CLI turns it off so a long-running
    #: process does not grow with its traffic.
    record_requests: bool = True
    #: Seconds a new connection has to complete the HTTP/2 handshake (docs/reliability.md).
    handshake_timeout: float = 10.0
    #: Seconds a connection may stay without open streams before GOAWAY and close (``None``: never).
    idle_timeout: float | None = 300.0
    #: Connections served at once; more are closed on accept (one WARNING line per 10 s).
    max_connections: int = 1000


@attrs.frozen(kw_only=True)
class PreparedConfig:
    """A checked :class:`MockConfig`: the listen address, mode, engine arguments, request policy and limits."""

    host: str
    port: int
    mode: Role
    args: _engine_args.EngineArgs
    policy: RequestPolicy
    config: MockConfig
    limits: ServerLimits


def prepare_config(config: MockConfig) -> PreparedConfig:
    """Every configuration check that needs no socket (the order of docs/reference/mock.md#startup-validation, then listen address and mode).

    Raises:
        MockConfigError: the first problem, with its documented message (docs/reference/mock.md#startup-validation).
    """
    try:
        args = (
            config.engine_args
            if isinstance(config.engine_args, _engine_args.EngineArgs)
            else _engine_args.engine_args_from_mapping(config.engine_args)
        )
        _engine_args.validate_engine_args(args, max_concurrent_requests=config.max_concurrent_requests)
    except _engine_args.EngineArgsError as exc:
        raise MockConfigError(str(exc)) from None
    if not 0 <= config.seed < 2**64:
        raise MockConfigError("seed must be an unsigned 64-bit integer")
    try:
        mode = Role.parse(config.disaggregation_mode)
    except ValueError:
        raise MockConfigError(
            f"invalid disaggregation mode '{config.disaggregation_mode}': expected aggregated, prefill, decode or encode"
        ) from None
    host, port = parse_listen(config.listen)
    try:
        limits = ServerLimits(
            handshake_timeout=config.handshake_timeout,
            idle_timeout=config.idle_timeout,
            max_connections=config.max_connections,
        )
    except ValueError as exc:
        raise MockConfigError(str(exc)) from None
    served = config.served_model_name or config.model
    try:
        scripts = load_scripts(args.scripted_completions, config.model) if args.scripted_completions else None
    except ValueError as exc:
        raise MockConfigError(str(exc)) from None
    policy = RequestPolicy(
        served_model_name=served,
        seed=config.seed,
        mode=mode,
        supports_multimodal=config.supports_multimodal,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.token_budget,
        enable_chunked_prefill=args.enable_chunked_prefill,
        token_seed_source=_enum_value(args.token_seed_source),
        image_token_id=args.image_token_id,
        tokens_per_image=args.tokens_per_image,
        lora=_lora.LoraTable(args.max_loras, (served,)) if args.max_loras > 0 else None,
        scripts=scripts,
        tokenize=_text_tokenizer(config.model),
    )
    return PreparedConfig(host=host, port=port, mode=mode, args=args, policy=policy, config=config, limits=limits)


def _text_tokenizer(model: str) -> Callable[[str], list[int]] | None:
    """Text prompts are served when the model is a directory with a tokenizer (``--tiny-model``) and the
    ``tokenizers`` package is installed (docs/reference/mock.md#request-validation)."""
    from trio_sidecar.shell.tokenizer import local_tokenizer

    encoder = local_tokenizer(model)
    return None if encoder is None else encoder.encode


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value
