"""gRPC wire helpers: message framing, ``grpc-message`` and ``grpc-timeout`` values (pure: no I/O)."""

from __future__ import annotations

import math
import struct
import urllib.parse
from collections.abc import Iterable

__all__ = ["decode_grpc_message", "encode_grpc_message", "encode_timeout", "frame_message", "frame_messages"]

_pack_message_prefix = struct.Struct(">BL").pack  # gRPC's message prefix: compressed flag, big-endian length


# -- message framing ---------------------------------------------------------------------------------


def frame_message(data: bytes) -> bytes:
    """One serialized message with its gRPC length prefix (never compressed)."""
    return _pack_message_prefix(0, len(data)) + data


def frame_messages(messages: Iterable[bytes]) -> bytes:
    """Serialized messages, each with its gRPC length prefix, back to back (one join)."""
    parts: list[bytes] = []
    append = parts.append
    for data in messages:
        append(_pack_message_prefix(0, len(data)))
        append(data)
    return b"".join(parts)


# -- header values -----------------------------------------------------------------------------------

# gRPC percent-encodes grpc-message bytes outside printable ASCII, and '%' itself.
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


def encode_grpc_message(message: str) -> str:
    return urllib.parse.quote(message, safe=_GRPC_MESSAGE_SAFE)


def decode_grpc_message(value: str) -> str:
    return urllib.parse.unquote(value, errors="replace")


_TIMEOUT_UNITS = (("u", 1_000_000), ("m", 1_000), ("S", 1), ("M", 1 / 60), ("H", 1 / 3600))


def encode_timeout(seconds: float) -> str:
    """Encode a positive timeout as a ``grpc-timeout`` value (at most 8 digits, rounded up)."""
    for unit, per_second in _TIMEOUT_UNITS:
        value = math.ceil(seconds * per_second)
        if value < 100_000_000:
            return f"{max(value, 1)}{unit}"
    return "99999999H"
