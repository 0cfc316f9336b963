"""Engine arguments of the mock (``--extra-engine-args``, docs/reference/mock.md#engine-arguments) — pure: no I/O besides
reading the optional JSON file, no Trio.

The accepted shape is the upstream split-stack's *flat* JSON object. Parsing and validation are two
steps with two kinds of failure, both reported as :class:`EngineArgsError`:

* :func:`parse_engine_args` / :func:`engine_args_from_mapping` check the JSON itself — syntax, trailing
  data, the top-level object, unknown keys, ``null`` for a non-nullable key, value types and the enums
  that only this project knows (``preemption_mode``, ``token_seed_source``).
* :func:`validate_engine_args` runs the startup checks of docs/reference/mock.md#startup-validation in the upstream mocker's order (the upstream
  service-specific checks first), then the project's own range checks.

``engine_type`` and ``worker_type`` are kept as (lower-cased) strings by the parser on purpose: a value
such as ``"sglang"`` or ``"prefill"`` must reach the startup checks (docs/reference/mock.md#startup-validation) and get the upstream message that names the key,
not a generic enum error.
"""

from __future__ import annotations

import difflib
import enum
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "EngineArgs",
    "EngineArgsError",
    "PreemptionMode",
    "TextMode",
    "TokenSeedSource",
    "engine_args_from_mapping",
    "load_engine_args_text",
    "parse_engine_args",
    "validate_engine_args",
]

# block_size 0 means "the upstream mock's vLLM default".
DEFAULT_BLOCK_SIZE = 64
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class EngineArgsError(Exception):
    """Bad ``--extra-engine-args`` (syntax, shape or a startup check of docs/reference/mock.md#startup-validation). ``str(e) == e.message``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionMode(enum.Enum):
    LIFO = "lifo"  # evict the newest running request (default, as vLLM)
    FIFO = "fifo"  # evict the oldest


class TextMode(enum.Enum):
    """How the mock turns output tokens into text (``text_mode``; see ``mock.generation``)."""

    TAGS = "tags"  # ``<token:{id}>`` per token: every message carries its token's text
    BYTES = "bytes"  # tokens are UTF-8 bytes, detokenized incrementally as vLLM does (text held back)
    WORDS = "words"  # `` {word}`` per token: the tiny model's vocabulary (``mock.tiny_model.word_text``)


class TokenSeedSource(enum.Enum):
    """What seeds the synthetic output tokens (docs/reference/mock.md#token-seed-and-request-uuid)."""

    REQUEST_ID = "request_id"
    PROMPT = "prompt"


@attrs.frozen(kw_only=True)
class EngineArgs:
    """The effective engine configuration of one mock server (defaults as in docs/reference/mock.md#engine-arguments).

    ``max_num_seqs`` / ``max_num_batched_tokens`` of ``None`` (JSON null) or 0 mean *unlimited*; the
    server reports them as 0 (docs/reference/mock.md#engine-arguments). ``block_size`` is already defaulted (never 0 here
    when built by the parser).
    """

    engine_type: str = "vllm"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = 16384
    max_num_seqs: int | None = 256
    max_num_batched_tokens: int | None = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    dp_size: int = 1
    worker_type: str = "aggregated"
    is_prefill: bool = False
    is_decode: bool = False
    max_model_len: int | None = None
    preemption_mode: PreemptionMode = PreemptionMode.LIFO
    startup_time: float | None = None
    zmq_kv_events_port: int | None = None
    zmq_replay_port: int | None = None
    # Project keys (docs/reference/mock.md#multimodal, docs/reference/mock.md#token-seed-and-request-uuid).
    token_seed_source: TokenSeedSource = TokenSeedSource.REQUEST_ID
    text_mode: TextMode = TextMode.TAGS
    image_token_id: int = 31999
    tokens_per_image: int = 16
    # LoRA and RL controls (docs/reference/mock.md#lora-adapters, docs/reference/mock.md#rl-controls).
    max_loras: int = 0
    enable_sleep_mode: bool = False
    weight_transfer_backend: str | None = None
    enable_draft_weight_updates: bool = False
    #: ``(prompt_contains, text)`` pairs: answer a matching prompt with this text (docs/reference/mock.md#scripted-completions).
    scripted_completions: tuple[tuple[str, str], ...] = ()
    # Control answers that only describe the deployment (docs/reference/mock.md#control-knobs).
    # ``data_parallel_rank`` is the first rank this server hosts and ``data_parallel_size_local`` how many
    # (None: every rank from ``data_parallel_rank`` to ``dp_size``; 0: the same ranks, reported as 0 like
    # a vLLM that omits the field). ``dp_size`` is the whole data-parallel group.
    data_parallel_rank: int = 0
    data_parallel_size_local: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int = 1
    # None: ``num_gpu_blocks`` × the hosted ranks, as vLLM sums them; a number: reported as is.
    total_kv_blocks: int | None = None
    # -1: the same as ``block_size``; None (JSON null): the optional field is absent.
    effective_attention_block_size: int | None = -1
    reasoning_parser: str = ""
    tool_call_parser: str = ""

    @property
    def local_ranks(self) -> range:
        """The global DP ranks this server simulates."""
        count = self.data_parallel_size_local or (self.dp_size - self.data_parallel_rank)
        return range(self.data_parallel_rank, self.data_parallel_rank + count)

    @property
    def seq_limit(self) -> int | None:
        """Running requests per rank, or None for unlimited."""
        return self.max_num_seqs or None

    @property
    def token_budget(self) -> int | None:
        """Tokens per scheduler pass, or None for unlimited."""
        return self.max_num_batched_tokens or None


# --- key table ----------------------------------------------------------------------------------------
# Each entry: (converter, nullable). A converter takes (key, value) and returns the field value or raises
# EngineArgsError. Keys mapped to None are accepted and ignored (upstream uses them for other timing
# models).


def _int(key: str, value: Any) -> int:
    # bool is an int subclass in Python; JSON true is not a number (serde rejects it too).
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineArgsError(f"engine arg '{key}' must be an integer")
    if value < 0:
        raise EngineArgsError(f"engine arg '{key}' must not be negative")
    return value


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineArgsError(f"engine arg '{key}' must be a number")
    result = float(value)
    if not math.isfinite(result):
        raise EngineArgsError(f"engine arg '{key}' must be a finite number")
    return result


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EngineArgsError(f"engine arg '{key}' must be a boolean")
    return value


def _name(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EngineArgsError(f"engine arg '{key}' must be a string")
    return value.lower()


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EngineArgsError(f"engine arg '{key}' must be a string")
    return value


def _enum(cls: type[enum.Enum]) -> Callable[[str, Any], enum.Enum]:
    def convert(key: str, value: Any) -> enum.Enum:
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        choices = ", ".join(member.value for member in cls)
        raise EngineArgsError(f"engine arg '{key}' must be one of: {choices}")

    return convert


def _scripts(key: str, value: Any) -> tuple[tuple[str, str], ...]:
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list):
        raise EngineArgsError(f"engine arg '{key}' must be a list of objects with a 'text'")
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            raise EngineArgsError(f"engine arg '{key}' entries must be objects with a string 'text'")
        unknown = sorted(set(entry) - {"prompt_contains", "text"})
        if unknown:
            raise EngineArgsError(f"engine arg '{key}' entries take 'prompt_contains' and 'text', not '{unknown[0]}'")
        contains = entry.get("prompt_contains", "")
        if not isinstance(contains, str):
            raise EngineArgsError(f"engine arg '{key}' entries' 'prompt_contains' must be a string")
        out.append((contains, entry["text"]))
    return tuple(out)


_IGNORED = object()

_KEYS: dict[str, tuple[Callable[[str, Any], Any], bool] | object] = {
    "engine_type": (_name, False),
    "block_size": (_int, False),
    "num_gpu_blocks": (_int, False),
    "max_num_seqs": (_int, True),
    "max_num_batched_tokens": (_int, True),
    "enable_prefix_caching": (_bool, False),
    "enable_chunked_prefill": (_bool, False),
    "speedup_ratio": (_float, False),
    "decode_speedup_ratio": (_float, False),
    "dp_size": (_int, False),
    "worker_type": (_name, False),
    "is_prefill": (_bool, False),
    "is_decode": (_bool, False),
    "max_model_len": (_int, True),
    "preemption_mode": (_enum(PreemptionMode), False),
    "startup_time": (_float, True),
    "zmq_kv_events_port": (_int, True),
    "zmq_replay_port": (_int, True),
    "max_loras": (_int, False),
    "enable_sleep_mode": (_bool, False),
    "weight_transfer_backend": (_text, True),
    "enable_draft_weight_updates": (_bool, False),
    "token_seed_source": (_enum(TokenSeedSource), False),
    "text_mode": (_enum(TextMode), False),
    "scripted_completions": (_scripts, False),
    "image_token_id": (_int, False),
    "tokens_per_image": (_int, False),
    "data_parallel_rank": (_int, False),
    "data_parallel_size_local": (_int, True),
    "tensor_parallel_size": (_int, False),
    "pipeline_parallel_size": (_int, False),
    "world_size": (_int, False),
    "effective_attention_block_size": (_int, True),
    "total_kv_blocks": (_int, True),
    "reasoning_parser": (_text, False),
    "tool_call_parser": (_text, False),
    "planner_profile_data": _IGNORED,
    "reasoning": _IGNORED,
    "kv_bytes_per_token": _IGNORED,
    "kv_transfer_bandwidth": _IGNORED,
}


# --- parsing ------------------------------------------------------------------------------------------


def unknown_key_message(key: object) -> str:
    """``unknown engine arg 'x'``, the closest valid key when one is close, and the valid keys."""
    valid = [name for name, entry in _KEYS.items() if entry is not _IGNORED]
    close = difflib.get_close_matches(str(key), valid, n=1)
    suggestion = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown engine arg '{key}'{suggestion} (valid keys: {', '.join(valid)})"


def load_engine_args_text(value: str) -> str:
    """Return the JSON text of ``--extra-engine-args``: the value itself when it is inline JSON (after
    leading whitespace it starts with ``{``, docs/reference/mock.md#cli), else the content of the file it names.

    Raises:
        EngineArgsError: the file cannot be read.
    """
    if value.lstrip().startswith("{"):
        return value
    if not os.path.exists(os.path.expanduser(value)) and _is_json(value):
        return value  # inline JSON that is not an object: parse_engine_args says so
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineArgsError(
            f"cannot read engine args file '{value}': {exc.strerror if isinstance(exc, OSError) else exc} "
            "(--extra-engine-args takes a JSON object such as '{\"speedup_ratio\": 0}' or a path to a JSON file)"
        ) from None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _reject_constant(name: str) -> None:
    raise EngineArgsError(f"invalid engine args JSON: {name} is not a valid JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise EngineArgsError(f"duplicate engine arg '{key}'")
        result[key] = value
    return result


def parse_engine_args(value: str | None) -> EngineArgs:
    """Parse ``--extra-engine-args`` (inline JSON or a file path; None → all defaults).

    Only the JSON is checked here; call :func:`validate_engine_args` for the startup checks (docs/reference/mock.md#startup-validation).

    Raises:
        EngineArgsError: unreadable file, invalid JSON, trailing data, a non-object top level, an unknown
            key, ``null`` for a non-nullable key, or a value of the wrong type.
    """
    if value is None:
        return EngineArgs()
    text = load_engine_args_text(value)
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise EngineArgsError(
                f"invalid engine args JSON: trailing data after the JSON value at line {exc.lineno} column {exc.colno}"
            ) from None
        raise EngineArgsError(f"invalid engine args JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise EngineArgsError(
            f"engine args must be a JSON object such as '{{\"speedup_ratio\": 0}}', not a JSON {_json_kind(obj)}"
        )
    return engine_args_from_mapping(obj)


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def engine_args_from_mapping(obj: Mapping[str, Any] | None) -> EngineArgs:
    """Build :class:`EngineArgs` from an already-decoded flat mapping (``MockConfig.engine_args``).

    Same key rules as :func:`parse_engine_args`; keys are checked in the mapping's order.
    """
    if obj is None:
        return EngineArgs()
    if not isinstance(obj, Mapping):
        raise EngineArgsError("engine args must be a JSON object")
    fields: dict[str, Any] = {}
    for key, value in obj.items():
        entry = _KEYS.get(key) if isinstance(key, str) else None
        if entry is None:
            raise EngineArgsError(unknown_key_message(key))
        if entry is _IGNORED:
            continue
        convert, nullable = cast("tuple[Callable[[str, Any], Any], bool]", entry)
        if value is None:
            if not nullable:
                raise EngineArgsError(f"engine arg '{key}' must not be null")
            fields[key] = None
            continue
        fields[key] = convert(key, value)
    if fields.get("block_size") == 0:
        fields["block_size"] = DEFAULT_BLOCK_SIZE
    return EngineArgs(**fields)


# --- startup validation (docs/reference/mock.md#startup-validation) ------------------------------------------------------------------------


def validate_engine_args(args: EngineArgs, *, max_concurrent_requests: int = 256) -> None:
    """The startup checks of docs/reference/mock.md#startup-validation, in the upstream mocker's order, then the project's own.

    ``max_concurrent_requests`` is the CLI value (checked third, between ``dp_size`` and
    ``worker_type``, as upstream).

    Raises:
        EngineArgsError: the first failing check; the message names the offending key.
    """
    if args.engine_type != "vllm":
        raise EngineArgsError("engine arg 'engine_type' must be \"vllm\"")
    if args.dp_size < 1:
        raise EngineArgsError("engine arg 'dp_size' must be at least 1")
    if max_concurrent_requests == 0:
        raise EngineArgsError("max_concurrent_requests (--max-concurrent-requests) must be greater than 0")
    if args.worker_type != "aggregated" or args.is_prefill or args.is_decode:
        raise EngineArgsError(
            "engine arg 'worker_type' must be \"aggregated\" (is_prefill and is_decode must be false); "
            "use --disaggregation-mode for the emulated wire role"
        )
    if args.num_gpu_blocks == 0:
        raise EngineArgsError("engine arg 'num_gpu_blocks' must be greater than 0")
    if args.block_size == 0:
        raise EngineArgsError("engine arg 'block_size' must be greater than 0")
    fits: tuple[tuple[str, int | None, int, str], ...] = (
        ("max_model_len", args.max_model_len, U32_MAX, "u32"),
        ("block_size", args.block_size, U32_MAX, "u32"),
        ("num_gpu_blocks", args.num_gpu_blocks * args.dp_size, U64_MAX, "u64"),
        ("max_num_seqs", args.max_num_seqs, U64_MAX, "u64"),
        ("max_num_batched_tokens", args.max_num_batched_tokens, U64_MAX, "u64"),
    )
    for key, value, limit, name in fits:
        if value is not None and value > limit:
            raise EngineArgsError(f"engine arg '{key}' must be at most {limit} (it does not fit in {name})")
    # Project checks (beyond docs/reference/mock.md#startup-validation): values the simulation cannot honour.
    if max_concurrent_requests < 0:
        raise EngineArgsError("max_concurrent_requests (--max-concurrent-requests) must be greater than 0")
    if args.speedup_ratio < 0:
        raise EngineArgsError("engine arg 'speedup_ratio' must not be negative")
    if args.decode_speedup_ratio <= 0:
        raise EngineArgsError("engine arg 'decode_speedup_ratio' must be greater than 0")
    for key, port in (
        ("zmq_kv_events_port", args.zmq_kv_events_port),
        ("zmq_replay_port", args.zmq_replay_port),
    ):
        if port is not None and port != 0 and port + args.dp_size - 1 > 65535:
            raise EngineArgsError(f"engine arg '{key}' must leave a port number (0..65535) for every DP rank")
    if args.tokens_per_image == 0:
        raise EngineArgsError("engine arg 'tokens_per_image' must be greater than 0")
    if args.image_token_id > U32_MAX:
        raise EngineArgsError(f"engine arg 'image_token_id' must be at most {U32_MAX}")
    if args.max_loras > U32_MAX:
        raise EngineArgsError(f"engine arg 'max_loras' must be at most {U32_MAX}")
    ranks = args.local_ranks
    if not ranks or ranks.stop > args.dp_size:
        raise EngineArgsError(
            "engine arg 'data_parallel_rank' plus 'data_parallel_size_local' must name 1..dp_size hosted ranks "
            f"(got ranks {ranks.start}..{ranks.stop - 1} of dp_size {args.dp_size})"
        )
    if args.enable_draft_weight_updates and not args.weight_transfer_backend:
        raise EngineArgsError("engine arg 'enable_draft_weight_updates' requires weight_transfer_backend")
