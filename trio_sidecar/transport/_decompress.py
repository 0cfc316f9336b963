"""gRPC message decompression bounded by the message limit (pure: no I/O).

purerpc 0.8.0 inflates with an unbounded ``zlib.decompress`` and reads ``gzip`` as zlib framing;
``BoundedReadBuffer`` replaces both (docs/reliability.md).
"""

from __future__ import annotations

import zlib

from purerpc.grpclib.buffers import MessageReadBuffer

from trio_sidecar.core.status import StatusCode

__all__ = ["BoundedReadBuffer", "MessageDecodeError", "buffered_flow_controlled_length"]


def buffered_flow_controlled_length(buffer: MessageReadBuffer) -> int:
    # purerpc 0.8.0 (pinned) internals: unparsed chunks, a parsed message prefix, parsed messages.
    total = sum(length for _, length in buffer._buffer._deque)
    total += buffer._flow_controlled_length or 0
    total += sum(length for _, length in buffer._messages)
    return total


class MessageDecodeError(Exception):
    """A compressed message that cannot be accepted; fails only its stream with ``code``."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


#: ``grpc-encoding`` values accepted on received messages, with the zlib window bits for each. gRPC's
#: ``gzip`` is RFC 1952 gzip framing and its ``deflate`` is zlib framing (RFC 1950), as grpcio's C core
#: compresses them (``deflateInit2`` with 15 | 16 window bits for gzip, 15 for deflate).
_ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# Inflate at most this much per step: a message over the limit is refused with about the limit held, never
# more (one ``decompress(data, limit + 1)`` peaks at twice that: CPython joins its output blocks at the end).
_INFLATE_CHUNK = 256 * 1024


class BoundedReadBuffer(MessageReadBuffer):
    """purerpc's message read buffer with bounded, gRPC-conformant decompression.

    purerpc 0.8.0 inflates with an unbounded ``zlib.decompress`` and reads ``gzip`` as zlib framing. Here
    the output of one message is capped at the message limit: ``zlib.decompressobj`` inflates it in steps
    of at most 256 KiB (``max_length``) and stops as soon as the total passes the limit, so a small
    compressed message cannot expand to gigabytes; a message over the limit fails its stream with
    RESOURCE_EXHAUSTED.
    """

    def decompress(self, data):  # type: ignore[no-untyped-def]
        encoding = self._message_encoding
        if encoding is None or encoding == "identity":
            raise MessageDecodeError(StatusCode.INTERNAL, "compressed message received without a grpc-encoding")
        wbits = _ZLIB_WBITS.get(encoding)
        if wbits is None:
            raise MessageDecodeError(
                StatusCode.UNIMPLEMENTED, f"message compressed with unsupported grpc-encoding {encoding!r}"
            )
        limit = self._max_message_length
        inflater = zlib.decompressobj(wbits)
        parts = []
        total = 0
        pending = data
        try:
            while not inflater.eof:
                out = inflater.decompress(pending, _INFLATE_CHUNK)
                pending = inflater.unconsumed_tail
                if not out and not pending:
                    raise MessageDecodeError(StatusCode.INTERNAL, f"truncated {encoding} message")
                total += len(out)
                if total > limit:
                    raise MessageDecodeError(
                        StatusCode.RESOURCE_EXHAUSTED,
                        f"received message larger than max after decompression (more than {limit} bytes)",
                    )
                parts.append(out)
        except zlib.error as exc:
            raise MessageDecodeError(StatusCode.INTERNAL, f"failed to decompress a {encoding} message: {exc}") from None
        return parts[0] if len(parts) == 1 else b"".join(parts)
